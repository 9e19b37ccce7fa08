#include "tools/model_spec.h"

#include <sys/stat.h>

#include <cctype>
#include <fstream>
#include <sstream>

namespace shardps::tools {

StatusOr<uint64_t> ParseBytes(const std::string& text) {
  size_t i = 0;
  uint64_t v = 0;
  while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) {
    const uint64_t d = static_cast<uint64_t>(text[i] - '0');
    if (v > (UINT64_MAX - d) / 10) return InvalidArgumentError("size '" + text + "' overflows");
    v = v * 10 + d;
    ++i;
  }
  if (i == 0) return InvalidArgumentError("size '" + text + "' does not start with a number");
  const std::string suffix = text.substr(i);
  int shift = 0;
  if (suffix.empty() || suffix == "B") {
    shift = 0;
  } else if (suffix == "K" || suffix == "KiB") {
    shift = 10;
  } else if (suffix == "M" || suffix == "MiB") {
    shift = 20;
  } else if (suffix == "G" || suffix == "GiB") {
    shift = 30;
  } else {
    return InvalidArgumentError("size '" + text + "': unknown suffix '" + suffix +
                                "' (K, KiB, M, MiB, G, GiB)");
  }
  if (shift > 0 && v > (UINT64_MAX >> shift)) {
    return InvalidArgumentError("size '" + text + "' overflows");
  }
  return v << shift;
}

StatusOr<std::vector<TensorSpec>> ParseModelSpec(const std::string& text,
                                                 const std::string& origin) {
  std::vector<TensorSpec> out;
  std::istringstream in(text);
  std::string line;
  int lineno = 0;
  while (std::getline(in, line)) {
    ++lineno;
    const size_t hash = line.find('#');
    if (hash != std::string::npos) line.resize(hash);
    std::istringstream ls(line);
    TensorSpec t;
    if (!(ls >> t.name)) continue;  // blank
    std::string dim;
    const std::string where = origin + ":" + std::to_string(lineno);
    if (t.name == "embedding") {
      // embedding NAME ROWS DIM [max_ids=N]: a row table (docs/embeddings.md).
      std::string rows, cols;
      if (!(ls >> t.name >> rows >> cols)) {
        return InvalidArgumentError(where + ": expected 'embedding NAME ROWS DIM [max_ids=N]'");
      }
      t.embedding = true;
      t.max_ids = 16384;
      for (const std::string* v : {&rows, &cols}) {
        if (v->empty() || v->find_first_not_of("0123456789") != std::string::npos ||
            v->size() > 15 || std::stoull(*v) == 0) {
          return InvalidArgumentError(where + ": '" + *v + "' is not a positive integer");
        }
        t.shape.push_back(static_cast<int64_t>(std::stoull(*v)));
      }
      std::string opt;
      while (ls >> opt) {
        if (opt.rfind("max_ids=", 0) != 0 || opt.size() == 8 || opt.size() > 16 ||
            opt.find_first_not_of("0123456789", 8) != std::string::npos) {
          return InvalidArgumentError(where + ": unknown table option '" + opt + "' (max_ids=N)");
        }
        t.max_ids = static_cast<uint32_t>(std::stoull(opt.substr(8)));
      }
      out.push_back(std::move(t));
      continue;
    }
    while (ls >> dim) {
      auto d = ParseBytes(dim);
      if (!d.ok() || dim.find_first_not_of("0123456789") != std::string::npos || *d == 0 ||
          *d > (1ull << 40)) {
        return InvalidArgumentError(where + ": dimension '" + dim +
                                    "' is not a positive integer");
      }
      t.shape.push_back(static_cast<int64_t>(*d));
    }
    if (t.shape.empty()) {
      return InvalidArgumentError(where + ": tensor '" + t.name + "' has no dimensions");
    }
    out.push_back(std::move(t));
  }
  if (out.empty()) return InvalidArgumentError(origin + ": no tensor");
  return out;
}

StatusOr<std::vector<TensorSpec>> LoadModelSpec(const std::string& model) {
  struct stat st{};
  if (!model.empty() && stat(model.c_str(), &st) == 0 && S_ISREG(st.st_mode)) {
    std::ifstream f(model);
    if (!f) return NotFoundError("cannot read model file " + model);
    std::ostringstream ss;
    ss << f.rdbuf();
    return ParseModelSpec(ss.str(), model);
  }
  auto bytes = ParseBytes(model);
  if (!bytes.ok()) {
    return InvalidArgumentError("--model '" + model +
                                "' is neither a file nor a size (bytes, or 256MiB style)");
  }
  if (*bytes < 4) return InvalidArgumentError("--model " + model + ": under one float32");
  TensorSpec t;
  t.name = "model";
  t.shape = {static_cast<int64_t>(*bytes / sizeof(float))};
  return std::vector<TensorSpec>{t};
}

}  // namespace shardps::tools
