// The Python module shardps._shardps (re-exported by the package shardps): shardps::Client for
// Python, taking numpy arrays and torch tensors zero-copy.
//
// Zero-copy: register() hands the array's own data pointer to Client::RegisterTensor (the
// memory is registered with the fabric; pulls land in it, pushes leave from it). Anything that
// would need a copy (another dtype, non-contiguous, read-only) is refused with TypeError or
// ValueError, never copied silently. The Client keeps a reference to every registered array,
// so the memory stays valid for the client's life. CUDA torch tensors are passed as device
// pointers; the library picks direct registration or the staging pipeline (tensor_path()).
//
// The GIL is released while the client blocks (connect, start, step, push, pull, wait).
// Thread safety: as shardps::Client, one thread at a time per Client object.
#include <cmath>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/row_init.h"
#include "shardps/client.h"

namespace py = pybind11;

namespace {

PyObject* g_error = nullptr;  // shardps.Error (a RuntimeError with .code)

[[noreturn]] void Raise(const shardps::Status& s) {
  py::object type = py::reinterpret_borrow<py::object>(g_error);
  py::object e = type(s.ToString());
  e.attr("code") = shardps::StatusCodeName(s.code());
  e.attr("message") = s.message();
  PyErr_SetObject(g_error, e.ptr());
  throw py::error_already_set();
}

void Check(const shardps::Status& s) {
  if (!s.ok()) Raise(s);
}

// A buffer of a Python object, described without copying it.
struct Buffer {
  void* data = nullptr;
  shardps::TensorDType dtype = shardps::TensorDType::kFloat32;
  std::vector<int64_t> shape;
  bool cuda = false;
};

// `read_only`: the buffer is only read (values to set), so a read-only numpy array is fine.
Buffer Describe(const py::object& obj, const std::string& what, bool read_only = false) {
  Buffer b;
  if (py::isinstance<py::array>(obj)) {
    py::array a = py::reinterpret_borrow<py::array>(obj);
    if (a.dtype().is(py::dtype("float16"))) {
      b.dtype = shardps::TensorDType::kFloat16;
    } else if (!a.dtype().is(py::dtype::of<float>())) {
      throw py::type_error(what + ": numpy array must be float32 or float16, not " +
                           std::string(py::str(a.dtype())) + " (a conversion would copy)");
    }
    if (!(a.flags() & py::array::c_style)) {
      throw py::value_error(what + ": numpy array must be C-contiguous (a copy would be needed)");
    }
    if (!a.writeable() && !read_only) {
      throw py::value_error(what + ": numpy array must be writeable");
    }
    b.data = const_cast<void*>(a.data());
    for (py::ssize_t i = 0; i < a.ndim(); ++i) b.shape.push_back(a.shape(i));
    if (b.shape.empty()) b.shape.push_back(1);
    return b;
  }
  if (py::hasattr(obj, "data_ptr") && py::hasattr(obj, "is_contiguous") &&
      py::hasattr(obj, "dtype")) {  // a torch.Tensor (torch is not linked: duck-typed)
    const std::string dtype = py::str(obj.attr("dtype"));
    if (dtype == "torch.float16") {
      b.dtype = shardps::TensorDType::kFloat16;
    } else if (dtype == "torch.bfloat16") {
      b.dtype = shardps::TensorDType::kBFloat16;
    } else if (dtype != "torch.float32") {
      throw py::type_error(what + ": torch tensor must be torch.float32, float16 or bfloat16, "
                           "not " + dtype);
    }
    if (!obj.attr("is_contiguous")().cast<bool>()) {
      throw py::value_error(what + ": torch tensor must be contiguous (a copy would be needed)");
    }
    b.data = reinterpret_cast<void*>(obj.attr("data_ptr")().cast<uintptr_t>());
    b.cuda = obj.attr("is_cuda").cast<bool>();
    for (auto d : obj.attr("shape")) b.shape.push_back(d.cast<int64_t>());
    if (b.shape.empty()) b.shape.push_back(1);
    return b;
  }
  throw py::type_error(what + ": expected a numpy.ndarray or a torch.Tensor, got " +
                       std::string(py::str(py::type::of(obj))));
}

// A host buffer of int64 ids (numpy int64 or torch.int64, contiguous): pointer and count.
std::pair<const int64_t*, size_t> DescribeIds(const py::object& obj) {
  if (py::isinstance<py::array>(obj)) {
    py::array a = py::reinterpret_borrow<py::array>(obj);
    if (!a.dtype().is(py::dtype::of<int64_t>())) {
      throw py::type_error("ids must be int64, not " + std::string(py::str(a.dtype())));
    }
    if (!(a.flags() & py::array::c_style)) throw py::value_error("ids must be C-contiguous");
    return {static_cast<const int64_t*>(a.data()), static_cast<size_t>(a.size())};
  }
  if (py::hasattr(obj, "data_ptr") && py::hasattr(obj, "dtype")) {
    if (std::string(py::str(obj.attr("dtype"))) != "torch.int64") {
      throw py::type_error("ids must be torch.int64");
    }
    if (!obj.attr("is_contiguous")().cast<bool>() || obj.attr("is_cuda").cast<bool>()) {
      throw py::value_error("ids must be a contiguous host tensor");
    }
    return {reinterpret_cast<const int64_t*>(obj.attr("data_ptr")().cast<uintptr_t>()),
            obj.attr("numel")().cast<size_t>()};
  }
  throw py::type_error("ids: expected a numpy int64 array or a torch.int64 tensor");
}

class PyClient {
 public:
  PyClient(const std::string& coordinator, const std::string& cluster_token, int rank,
           const std::string& transport, const std::string& bind_ip, const std::string& rdma_device,
           int rdma_gid_index, int64_t setup_timeout_ms, int64_t wait_timeout_ms,
           uint64_t cuda_pipeline_bytes, int metrics_port, const std::string& metrics_address,
           const std::string& metrics_address_file, const std::string& trace_file,
           uint64_t trace_max_events, int64_t busy_poll_us) {
    shardps::ClientOptions o;
    o.coordinator = coordinator;
    o.cluster_token = cluster_token;
    o.requested_rank = rank;
    o.transport = transport;
    o.bind_ip = bind_ip;
    o.rdma_device = rdma_device;
    o.rdma_gid_index = rdma_gid_index;
    o.setup_timeout = std::chrono::milliseconds(setup_timeout_ms);
    o.wait_timeout = std::chrono::milliseconds(wait_timeout_ms);
    o.cuda_pipeline_bytes = cuda_pipeline_bytes;
    o.metrics_port = metrics_port;
    o.metrics_address = metrics_address;
    o.metrics_address_file = metrics_address_file;
    o.trace_file = trace_file;
    o.trace_max_events = trace_max_events;
    o.busy_poll = std::chrono::microseconds(busy_poll_us);
    shardps::StatusOr<std::unique_ptr<shardps::Client>> c = shardps::InternalError("unset");
    {
      py::gil_scoped_release nogil;
      c = shardps::Client::Connect(o);
    }
    if (!c.ok()) Raise(c.status());
    client_ = std::move(c).value();
  }

  void Register(const std::string& name, py::object weights, py::object grads) {
    shardps::Client& c = Live();
    const Buffer w = Describe(weights, "weights of '" + name + "'");
    const Buffer g = Describe(grads, "grads of '" + name + "'");
    if (w.shape != g.shape)
      throw py::value_error("'" + name + "': weights and grads differ in shape");
    if (w.cuda != g.cuda) {
      throw py::value_error("'" + name + "': weights and grads must be on the same device");
    }
    // A CUDA tensor this library cannot see as device memory would be registered as host memory
    // and read by the transport's CPU: refuse it here, saying why.
    for (const Buffer* b : {&w, &g}) {
      if (b->cuda && !shardps::IsCudaDeviceMemory(b->data)) {
        throw py::value_error(
            "'" + name + "' is a CUDA tensor, but " +
            (shardps::BuiltWithCuda()
                 ? std::string("the CUDA runtime of this shardps does not see its memory as "
                               "device memory (no CUDA driver or device visible to it?)")
                 : std::string("this shardps was built without CUDA (no toolkit at build time; "
                               "rebuild with the CUDA toolkit, -DSHARDPS_WITH_CUDA=ON)")) +
            "; move the model to the CPU or rebuild (docs/python.md, \"GPU learners\")");
      }
    }
    if (w.data == g.data) throw py::value_error("'" + name + "': weights and grads are one buffer");
    if (w.dtype != g.dtype) {
      throw py::type_error("'" + name + "': weights and grads differ in dtype");
    }
    Check(c.RegisterTensor(name, w.data, g.data, w.shape, w.dtype));
    // Held for the client's life: the registered memory must not be freed under it.
    tensors_[name] = Held{weights, grads, w.data, g.data};
  }

  void RegisterEmbedding(const std::string& name, int64_t rows, int64_t dim,
                         const std::string& dtype, uint32_t max_ids, const std::string& init,
                         float init_scale, uint64_t init_seed, bool hashed,
                         float admit_probability, uint32_t cache_rows) {
    shardps::TensorDType t;
    if (dtype == "float32") {
      t = shardps::TensorDType::kFloat32;
    } else if (dtype == "float16") {
      t = shardps::TensorDType::kFloat16;
    } else if (dtype == "bfloat16") {
      t = shardps::TensorDType::kBFloat16;
    } else {
      throw py::value_error("dtype must be 'float32', 'float16' or 'bfloat16'");
    }
    shardps::EmbeddingOptions o;
    o.max_ids = max_ids;
    if (init == "normal") {
      o.init = shardps::EmbeddingOptions::Init::kNormal;
    } else if (init == "uniform") {
      o.init = shardps::EmbeddingOptions::Init::kUniform;
    } else if (init == "zeros") {
      o.init = shardps::EmbeddingOptions::Init::kZeros;
    } else {
      throw py::value_error("init must be 'normal', 'uniform' or 'zeros'");
    }
    o.init_scale = init_scale;
    o.init_seed = init_seed;
    o.hashed = hashed;
    o.admit_probability = admit_probability;
    o.cache_rows = cache_rows;
    Check(Live().RegisterEmbedding(name, rows, dim, t, o));
    tables_[name] = {dim, t};
  }
  // Rows `ids` of table `name` into `out` (n x dim, the table's dtype, contiguous host).
  void PullRows(const std::string& name, const py::object& ids, const py::object& out) {
    const auto [p, n] = DescribeIds(ids);
    const Buffer b = Describe(out, "rows output of '" + name + "'");
    CheckRowsBuffer(name, b, n);
    Blocking([&](shardps::Client& c) { return c.PullRows(name, p, n, b.data); });
  }
  void AddRowGrads(const std::string& name, const py::object& ids, const py::object& grads) {
    const auto [p, n] = DescribeIds(ids);
    const Buffer b = Describe(grads, "row gradients of '" + name + "'");
    CheckRowsBuffer(name, b, n);
    Check(Live().AddRowGradients(name, p, n, b.data));
  }
  void Start() {
    Blocking([](shardps::Client& c) { return c.Start(); });
  }
  void Step() {
    Blocking([](shardps::Client& c) { return c.Step(); });
  }
  void Clock() { Check(Live().Clock()); }
  void SetLearningRate(const std::string& name, float lr) {
    Check(Live().SetLearningRate(name, lr));
  }
  void SetUpdateRule(const std::string& name, const std::string& kind, float lr, float momentum,
                     float dampening, bool nesterov, float weight_decay, float beta1,
                     float beta2, float eps, float lr_decay, float initial_accumulator_value) {
    shardps::UpdateRule r;
    if (kind == "server") {
      r.kind = shardps::UpdateRule::Kind::kServer;
    } else if (kind == "sgd") {
      r.kind = shardps::UpdateRule::Kind::kSgd;
    } else if (kind == "adam") {
      r.kind = shardps::UpdateRule::Kind::kAdam;
    } else if (kind == "adamw") {
      r.kind = shardps::UpdateRule::Kind::kAdamW;
    } else if (kind == "store") {
      r.kind = shardps::UpdateRule::Kind::kStore;
    } else if (kind == "adagrad") {
      r.kind = shardps::UpdateRule::Kind::kAdagrad;
    } else {
      Check(shardps::InvalidArgumentError("unknown update rule '" + kind +
                                          "' (server, sgd, adam, adamw, adagrad, store)"));
    }
    r.lr_decay = lr_decay;
    r.initial_accumulator_value = initial_accumulator_value;
    r.lr = lr;
    r.momentum = momentum;
    r.dampening = dampening;
    r.nesterov = nesterov;
    r.weight_decay = weight_decay;
    r.beta1 = beta1;
    r.beta2 = beta2;
    r.eps = eps;
    Check(Live().SetUpdateRule(name, r));
  }
  void MarkNonFinite(bool v) { Live().MarkNonFinite(v); }
  bool ScaleRowGrads(const std::string& name, float factor) {
    shardps::StatusOr<bool> finite = Live().ScaleRowGradients(name, factor);
    Check(finite.status());
    return *finite;
  }
  double RowGradsSquaredNorm(const std::string& name) {
    shardps::StatusOr<double> sum = Live().RowGradientsSquaredNorm(name);
    Check(sum.status());
    return *sum;
  }
  void ClearRowGrads(const std::string& name) { Check(Live().ClearRowGradients(name)); }
  void SetNoGradient(const std::string& name, bool v) { Check(Live().SetNoGradient(name, v)); }
  // 'weights', 'state1', 'state2' (and 'none' where `none` is allowed) -> the StatePart.
  static shardps::Client::StatePart ParsePart(const std::string& part, bool none) {
    using P = shardps::Client::StatePart;
    if (part == "weights") return P::kWeights;
    if (part == "state1") return P::kState1;
    if (part == "state2") return P::kState2;
    if (none && part == "none") return P::kNoState;
    throw py::value_error(none ? "part must be 'weights', 'state1', 'state2' or 'none'"
                               : "part must be 'weights', 'state1' or 'state2' (values are "
                                 "set; 'none' drops the state without values)");
  }
  int64_t TensorElements(const std::string& name) {
    auto it = tensors_.find(name);
    if (it == tensors_.end()) Raise(shardps::NotFoundError("no tensor '" + name + "'"));
    int64_t n = 1;
    for (int64_t d : Describe(it->second.weights, "'" + name + "'").shape) n *= d;
    return n;
  }
  // From the gradient buffer, or from `values` (a float32 host buffer of the tensor's element
  // count: a 16-bit tensor's float32 master and state, set exactly).
  void SetState(const std::string& name, const std::string& part, uint64_t steps,
                const py::object& values) {
    if (values.is_none()) {
      const shardps::Client::StatePart p = ParsePart(part, /*none=*/true);
      Blocking([&](shardps::Client& c) { return c.SetState(name, p, steps); });
      return;
    }
    const shardps::Client::StatePart p = ParsePart(part, /*none=*/false);
    const Buffer b = Describe(values, "state values of '" + name + "'", /*read_only=*/true);
    if (b.dtype != shardps::TensorDType::kFloat32 || b.cuda) {
      throw py::type_error("'" + name + "': state values are a float32 host buffer");
    }
    int64_t elems = 1;
    for (int64_t d : b.shape) elems *= d;
    const int64_t want = TensorElements(name);
    if (elems != want) {
      throw py::value_error("'" + name + "': state values hold " + std::to_string(elems) +
                            " values, not the tensor's " + std::to_string(want));
    }
    const auto* v = static_cast<const float*>(b.data);
    Blocking([&](shardps::Client& c) { return c.SetStateValues(name, p, v, steps); });
  }
  // Into float32 buffers (numpy or torch, contiguous) of the tensor's element count, or None.
  py::tuple GetState(const std::string& name, py::object weights, py::object state1,
                     py::object state2) {
    float* out[3] = {nullptr, nullptr, nullptr};
    py::object objs[3] = {weights, state1, state2};
    for (int i = 0; i < 3; ++i) {
      if (objs[i].is_none()) continue;
      const Buffer b = Describe(objs[i], "state output");
      if (b.dtype != shardps::TensorDType::kFloat32 || b.cuda) {
        throw py::type_error("state outputs are float32 host buffers");
      }
      out[i] = static_cast<float*>(b.data);
    }
    uint64_t steps = 0;
    bool has1 = false, has2 = false;
    Blocking([&](shardps::Client& c) {
      return c.GetState(name, out[0], out[1], out[2], &steps, &has1, &has2);
    });
    return py::make_tuple(steps, has1, has2);
  }
  // Row tables' state (Client::SetRows / GetRows / TableKeys): float32 host buffers of
  // len(ids) x dim values.
  float* RowStateBuffer(const std::string& name, const py::object& obj, size_t n,
                        const char* what) {
    auto it = tables_.find(name);
    if (it == tables_.end()) Raise(shardps::NotFoundError("no row table '" + name + "'"));
    const Buffer b = Describe(obj, std::string(what) + " of '" + name + "'");
    int64_t elems = 1;
    for (int64_t d : b.shape) elems *= d;
    if (b.dtype != shardps::TensorDType::kFloat32 || b.cuda) {
      throw py::type_error("'" + name + "': " + what + " is a float32 host buffer");
    }
    if (elems != static_cast<int64_t>(n) * it->second.dim) {
      throw py::value_error("'" + name + "': " + what + " holds " + std::to_string(elems) +
                            " values, not len(ids) x dim = " +
                            std::to_string(static_cast<int64_t>(n) * it->second.dim));
    }
    return static_cast<float*>(b.data);
  }
  void SetRows(const std::string& name, const std::string& part, const py::object& ids,
               const py::object& values, uint64_t steps) {
    const shardps::Client::StatePart p = ParsePart(part, /*none=*/false);
    const auto [id, n] = DescribeIds(ids);
    const float* v = RowStateBuffer(name, values, n, "values");
    Blocking([&](shardps::Client& c) { return c.SetRows(name, p, id, n, v, steps); });
  }
  py::tuple GetRows(const std::string& name, const py::object& ids, py::object weights,
                    py::object state1, py::object state2) {
    const auto [id, n] = DescribeIds(ids);
    float* out[3] = {nullptr, nullptr, nullptr};
    py::object objs[3] = {weights, state1, state2};
    const char* what[3] = {"weights output", "state1 output", "state2 output"};
    for (int i = 0; i < 3; ++i) {
      if (!objs[i].is_none()) out[i] = RowStateBuffer(name, objs[i], n, what[i]);
    }
    shardps::Client::RowStateInfo info;
    Blocking([&](shardps::Client& c) {
      return c.GetRows(name, id, n, out[0], out[1], out[2], &info);
    });
    return py::make_tuple(info.steps, info.has1, info.has2);
  }
  py::array_t<int64_t> TableKeys(const std::string& name) {
    shardps::Client& c = Live();
    shardps::StatusOr<std::vector<int64_t>> keys = shardps::InternalError("unset");
    {
      py::gil_scoped_release nogil;
      keys = c.TableKeys(name);
    }
    if (!keys.ok()) Raise(keys.status());
    py::array_t<int64_t> out(static_cast<py::ssize_t>(keys->size()));
    if (!keys->empty()) std::memcpy(out.mutable_data(), keys->data(), keys->size() * sizeof(int64_t));
    return out;
  }
  void Barrier(double timeout_s) {
    if (!(timeout_s >= 0.0) || timeout_s > 1e9) {  // NaN too
      throw py::value_error("barrier timeout: seconds in [0, 1e9] (0: the setup timeout)");
    }
    // Rounded up: a positive timeout under 1 ms is 1 ms, not 0 (which means the setup timeout).
    const auto ms = std::chrono::milliseconds(static_cast<int64_t>(std::ceil(timeout_s * 1000.0)));
    Blocking([&](shardps::Client& c) { return c.Barrier(ms); });
  }
  uint64_t RequestCheckpoint(const std::string& dir) {
    shardps::Client& c = Live();
    shardps::StatusOr<uint64_t> clock = shardps::InternalError("unset");
    {
      py::gil_scoped_release nogil;
      clock = c.RequestCheckpoint(dir);
    }
    if (!clock.ok()) Raise(clock.status());
    return *clock;
  }
  uint64_t Push(const std::string& name) { return Async(name, true); }
  uint64_t Pull(const std::string& name) { return Async(name, false); }
  std::vector<uint64_t> PushMany(const std::vector<std::string>& names) {
    return AsyncMany(names, true);
  }
  std::vector<uint64_t> PullMany(const std::vector<std::string>& names) {
    return AsyncMany(names, false);
  }
  void Wait(uint64_t h) {
    Blocking([h](shardps::Client& c) { return c.Wait(shardps::Handle{h}); });
  }
  void Close() {
    if (client_ == nullptr) return;
    shardps::Status s;
    {
      py::gil_scoped_release nogil;
      s = client_->Close();
    }
    Check(s);
  }

  uint32_t rank() { return Live().rank(); }
  uint32_t num_workers() { return Live().num_workers(); }
  uint64_t clock() { return Live().clock(); }
  uint64_t barrier_generation() { return Live().barrier_generation(); }
  std::string consistency() { return Live().consistency(); }
  std::string transport() { return Live().transport_name(); }
  std::string tensor_path(const std::string& name) {
    auto p = Live().tensor_path(name);
    if (!p.ok()) Raise(p.status());
    return shardps::TensorPathName(*p);
  }
  // The addresses given to RegisterTensor: (weights, grads).
  std::pair<uintptr_t, uintptr_t> registered_address(const std::string& name) {
    auto it = tensors_.find(name);
    if (it == tensors_.end()) Raise(shardps::NotFoundError("no tensor '" + name + "'"));
    return {reinterpret_cast<uintptr_t>(it->second.w), reinterpret_cast<uintptr_t>(it->second.g)};
  }
  py::dict counters() {
    const shardps::ClientCounters k = Live().counters();
    py::dict d;
    d["control_messages_sent"] = k.control_messages_sent;
    d["heartbeats_sent"] = k.heartbeats_sent;
    d["pushes"] = k.pushes;
    d["pulls"] = k.pulls;
    d["pull_retries"] = k.pull_retries;
    d["pull_other_buffer"] = k.pull_other_buffer;
    d["failovers"] = k.failovers;
    d["pushes_resent"] = k.pushes_resent;
    d["pushes_lost"] = k.pushes_lost;
    d["bytes_pushed"] = k.bytes_pushed;
    d["bytes_pulled"] = k.bytes_pulled;
    d["rows_pulled"] = k.rows_pulled;
    d["row_reads"] = k.row_reads;
    d["row_retries"] = k.row_retries;
    d["rows_pushed"] = k.rows_pushed;
    d["row_cache_hits"] = k.row_cache_hits;
    d["row_cache_misses"] = k.row_cache_misses;
    d["row_cache_staleness"] = k.row_cache_staleness;
    return d;
  }

 private:
  struct Held {
    py::object weights, grads;
    void* w;
    void* g;
  };
  struct TableInfo {
    int64_t dim;
    shardps::TensorDType dtype;
  };
  void CheckRowsBuffer(const std::string& name, const Buffer& b, size_t n) {
    auto it = tables_.find(name);
    if (it == tables_.end()) Raise(shardps::NotFoundError("no row table '" + name + "'"));
    int64_t elems = 1;
    for (int64_t d : b.shape) elems *= d;
    if (b.cuda) throw py::value_error("'" + name + "': row buffers are host memory");
    if (b.dtype != it->second.dtype) {
      throw py::type_error("'" + name + "': row buffer dtype differs from the table's");
    }
    if (elems != static_cast<int64_t>(n) * it->second.dim) {
      throw py::value_error("'" + name + "': row buffer holds " + std::to_string(elems) +
                            " values, not len(ids) x dim = " +
                            std::to_string(static_cast<int64_t>(n) * it->second.dim));
    }
  }
  std::map<std::string, TableInfo> tables_;
  shardps::Client& Live() {
    if (client_ == nullptr) Raise(shardps::FailedPreconditionError("client is closed"));
    return *client_;
  }
  template <typename Fn>
  void Blocking(Fn fn) {
    shardps::Client& c = Live();
    shardps::Status s;
    {
      py::gil_scoped_release nogil;
      s = fn(c);
    }
    Check(s);
  }
  uint64_t Async(const std::string& name, bool push) {
    shardps::Client& c = Live();
    shardps::StatusOr<shardps::Handle> h = shardps::InternalError("unset");
    {
      py::gil_scoped_release nogil;
      h = push ? c.Push(name) : c.Pull(name);
    }
    if (!h.ok()) Raise(h.status());
    return h->id;
  }

  std::vector<uint64_t> AsyncMany(const std::vector<std::string>& names, bool push) {
    shardps::Client& c = Live();
    shardps::StatusOr<std::vector<shardps::Handle>> hs = shardps::InternalError("unset");
    {
      py::gil_scoped_release nogil;
      hs = push ? c.PushMany(names) : c.PullMany(names);
    }
    if (!hs.ok()) Raise(hs.status());
    std::vector<uint64_t> ids;
    for (shardps::Handle h : *hs) ids.push_back(h.id);
    return ids;
  }

  std::unique_ptr<shardps::Client> client_;
  std::map<std::string, Held> tensors_;
};

}  // namespace

PYBIND11_MODULE(_shardps, m) {
  m.doc() = "ShardPS worker client (see docs/python.md)";
  g_error = PyErr_NewExceptionWithDoc(
      "shardps.Error", "A ShardPS error; .code is the status code name, .message the text.",
      PyExc_RuntimeError, nullptr);
  m.attr("Error") = py::reinterpret_borrow<py::object>(g_error);
  const shardps::ClientOptions d;
  m.def(
      "row_init",
      [](const std::string& init, float scale, uint64_t seed, py::array_t<int64_t> ids,
         uint32_t dim) {
        shardps::RowInitKind k = init == "uniform" ? shardps::RowInitKind::kUniform
                                 : init == "zeros" ? shardps::RowInitKind::kZeros
                                                   : shardps::RowInitKind::kNormal;
        if (init != "normal" && init != "uniform" && init != "zeros") {
          throw py::value_error("init must be 'normal', 'uniform' or 'zeros'");
        }
        auto in = ids.unchecked<1>();
        py::array_t<float> out({static_cast<py::ssize_t>(in.shape(0)), static_cast<py::ssize_t>(dim)});
        float* o = out.mutable_data();
        for (py::ssize_t i = 0; i < in.shape(0); ++i) {
          shardps::InitRow(k, scale, seed, static_cast<uint64_t>(in(i)), dim, o + i * dim);
        }
        return out;
      },
      py::arg("init"), py::arg("scale"), py::arg("seed"), py::arg("ids"), py::arg("dim"),
      "The initial values the servers give rows `ids` of a table (float32, len(ids) x dim).");
  m.def("built_with_cuda", &shardps::BuiltWithCuda,
        "Whether this shardps was built with CUDA (device tensors supported).");
  py::class_<PyClient>(m, "Client")
      .def(py::init<const std::string&, const std::string&, int, const std::string&,
                    const std::string&, const std::string&, int, int64_t, int64_t, uint64_t,
                    int, const std::string&, const std::string&, const std::string&, uint64_t,
                    int64_t>(),
           py::arg("coordinator") = "", py::arg("cluster_token") = "", py::arg("rank") = -1,
           py::arg("transport") = "auto", py::arg("bind_ip") = "", py::arg("rdma_device") = "",
           py::arg("rdma_gid_index") = -1,
           py::arg("setup_timeout_ms") = static_cast<int64_t>(d.setup_timeout.count()),
           py::arg("wait_timeout_ms") = static_cast<int64_t>(d.wait_timeout.count()),
           py::arg("cuda_pipeline_bytes") = d.cuda_pipeline_bytes,
           py::arg("metrics_port") = d.metrics_port, py::arg("metrics_address") = d.metrics_address,
           py::arg("metrics_address_file") = d.metrics_address_file, py::arg("trace_file") = "",
           py::arg("trace_max_events") = d.trace_max_events,
           py::arg("busy_poll_us") = static_cast<int64_t>(d.busy_poll.count()),
           "Joins the cluster at coordinator (host:port). Unset settings come from the "
           "environment: SHARDPS_COORDINATOR, SHARDPS_CLUSTER_TOKEN, SHARDPS_TRANSPORT, "
           "SHARDPS_METRICS_PORT (metrics_port: serve Prometheus /metrics; 0 off, -1 any free "
           "port), SHARDPS_TRACE_FILE (trace_file: a timeline trace, docs/tracing.md), "
           "SHARDPS_BUSY_POLL_US (busy_poll_us: how long a wait polls before it sleeps; -1 "
           "never sleeps), and the "
           "rank from SHARDPS_RANK, OMPI_COMM_WORLD_RANK, PMI_RANK, SLURM_PROCID or RANK.")
      .def("register", &PyClient::Register, py::arg("name"), py::arg("weights"), py::arg("grads"),
           "Registers float32 weights and grads (numpy or torch, contiguous) without copying.")
      .def("register_embedding", &PyClient::RegisterEmbedding, py::arg("name"), py::arg("rows"),
           py::arg("dim"), py::arg("dtype") = "float32", py::arg("max_ids") = 16384,
           py::arg("init") = "normal", py::arg("init_scale") = 1.0f, py::arg("init_seed") = 0,
           py::arg("hashed") = false, py::arg("admit_probability") = 1.0f,
           py::arg("cache_rows") = 0,
           "Registers a row table (an embedding) of rows x dim, sharded by row id over the "
           "servers and initialised there (init: 'normal' N(0, scale^2), 'uniform' "
           "U(-scale, scale), 'zeros'; shardps.row_init computes the same values).")
      .def("pull_rows", &PyClient::PullRows, py::arg("name"), py::arg("ids"), py::arg("out"),
           "Reads rows `ids` (int64) of a table into `out` (len(ids) x dim, the table's dtype) "
           "with one-sided reads, at the consistency bound of the current clock.")
      .def("add_row_grads", &PyClient::AddRowGrads, py::arg("name"), py::arg("ids"),
           py::arg("grads"),
           "Adds gradient rows for `ids` to the table's gradient of this step (duplicates "
           "summed); the next push or step sends it.")
      .def("start", &PyClient::Start)
      .def("step", &PyClient::Step, "Push every tensor not pushed yet in this clock (row tables: their gradient rows), clock, pull every dense tensor (Client::Step).")
      .def("push", &PyClient::Push, py::arg("name"))
      .def("pull", &PyClient::Pull, py::arg("name"))
      .def("push_many", &PyClient::PushMany, py::arg("names"),
           "Push several tensors; their posts leave together (one handle each, to wait).")
      .def("pull_many", &PyClient::PullMany, py::arg("names"),
           "Pull several tensors; their posts leave together (one handle each, to wait).")
      .def("wait", &PyClient::Wait, py::arg("handle"))
      .def("clock", &PyClient::Clock)
      .def("set_lr", &PyClient::SetLearningRate, py::arg("name"), py::arg("lr"),
           "The learning rate the servers apply to this worker's next pushes of tensor `name` "
           "('' = every tensor; 0 = the servers' --lr); it travels with the pushes.")
      .def("set_rule", &PyClient::SetUpdateRule, py::arg("name"), py::arg("kind"),
           py::arg("lr"), py::arg("momentum") = 0.0f, py::arg("dampening") = 0.0f,
           py::arg("nesterov") = false, py::arg("weight_decay") = 0.0f,
           py::arg("beta1") = 0.9f, py::arg("beta2") = 0.999f, py::arg("eps") = 1e-8f,
           py::arg("lr_decay") = 0.0f, py::arg("initial_accumulator_value") = 0.0f,
           "The update rule ('server', 'sgd', 'adam', 'adamw', 'adagrad', 'store') and "
           "hyper-parameters the "
           "servers apply to this worker's next pushes of tensor `name` ('' = every tensor), "
           "with torch.optim's semantics; it travels with the pushes.")
      .def("set_state", &PyClient::SetState, py::arg("name"), py::arg("part"),
           py::arg("steps") = 0, py::arg("values") = py::none(),
           "Sets part ('weights', 'state1', 'state2'; 'none' drops the optimizer state) of "
           "tensor `name` on the servers to the values in its registered GRADIENT buffer, or "
           "to `values` (float32 host buffer of the tensor's element count, whatever its "
           "dtype: a 16-bit tensor's float32 master and state, exactly), and the optimizer "
           "step count to `steps` (Client::SetState / SetStateValues).")
      .def("get_state", &PyClient::GetState, py::arg("name"), py::arg("weights") = py::none(),
           py::arg("state1") = py::none(), py::arg("state2") = py::none(),
           "Reads the servers' float32 master weights and optimizer state of tensor `name` "
           "into the given float32 buffers (None: skipped); returns (steps, has_state1, "
           "has_state2).")
      .def("set_rows", &PyClient::SetRows, py::arg("name"), py::arg("part"), py::arg("ids"),
           py::arg("values"), py::arg("steps") = 0,
           "Sets part ('weights', 'state1', 'state2') of rows `ids` (int64, distinct) of row "
           "table `name` to `values` (float32, len(ids) x dim), and for a state part the "
           "table's optimizer step count to `steps` (Client::SetRows).")
      .def("get_rows", &PyClient::GetRows, py::arg("name"), py::arg("ids"),
           py::arg("weights") = py::none(), py::arg("state1") = py::none(),
           py::arg("state2") = py::none(),
           "Reads rows `ids` of row table `name`: float32 values and optimizer state rows "
           "into the given buffers (len(ids) x dim; None: skipped); returns (steps, "
           "has_state1, has_state2) (Client::GetRows).")
      .def("table_keys", &PyClient::TableKeys, py::arg("name"),
           "The keys holding a row in hashed row table `name` (int64 numpy array).")
      .def("set_no_gradient", &PyClient::SetNoGradient, py::arg("name"), py::arg("no_gradient"),
           "Marks the next pushes of a tensor as carrying no gradient (a frozen parameter, or "
           "none this step): BSP leaves a chunk whose pushes all carry the mark as it is, "
           "optimizer state included (see Client::SetNoGradient).")
      .def("scale_row_grads", &PyClient::ScaleRowGrads, py::arg("name"), py::arg("factor"),
           "Multiplies the table's gradient rows of this step (not yet pushed) by `factor` (a "
           "GradScaler's 1/scale); returns whether all are finite.")
      .def("row_grads_squared_norm", &PyClient::RowGradsSquaredNorm, py::arg("name"),
           "The sum of the squares of the table's gradient rows of this step (not yet pushed): "
           "its share of a global gradient norm (inf or nan where one is not finite).")
      .def("clear_row_grads", &PyClient::ClearRowGrads, py::arg("name"),
           "Drops the table's gradient rows of this step (not yet pushed): zero_grad().")
      .def("mark_non_finite", [](PyClient& c, bool v) { c.MarkNonFinite(v); },
           py::arg("non_finite"),
           "The next pushes come from a step whose gradients were not all finite: BSP skips "
           "the clock's update on every server (see Client::MarkNonFinite).")
      .def("barrier", &PyClient::Barrier, py::arg("timeout") = 0.0,
           "Waits until every live worker has called barrier() as often as this one (e.g. "
           "after every worker loaded a checkpoint under SSP/ASP); timeout in seconds, 0: the "
           "setup timeout (Client::Barrier).")
      .def("request_checkpoint", &PyClient::RequestCheckpoint, py::arg("dir") = "",
           "Asks every server for a checkpoint at the next clock; returns that clock.")
      .def("close", &PyClient::Close)
      .def_property_readonly("rank", &PyClient::rank)
      .def_property_readonly("num_workers", &PyClient::num_workers)
      .def_property_readonly("clock_value", &PyClient::clock)
      .def_property_readonly("barrier_generation", &PyClient::barrier_generation,
                             "The newest barrier generation passed (or released by the cluster "
                             "when this worker joined); the next barrier() is this + 1.")
      .def_property_readonly("consistency", &PyClient::consistency)
      .def_property_readonly("transport", &PyClient::transport)
      .def("tensor_path", &PyClient::tensor_path, py::arg("name"))
      .def("registered_address", &PyClient::registered_address, py::arg("name"))
      .def("counters", &PyClient::counters)
      .def("__enter__", [](PyClient& c) -> PyClient& { return c; })
      .def("__exit__", [](PyClient& c, py::args) { c.Close(); });
}
