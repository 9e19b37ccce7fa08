// JsonQuote (proto/json_string.h): what the tools print as JSON strings parses back, through
// protobuf's JSON parser, to the bytes given; bytes that are not UTF-8 become U+FFFD.
#include "proto/json_string.h"

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>
#include <gtest/gtest.h>

#include <string>

namespace shardps::control {
namespace {

std::string RoundTrip(const std::string& quoted) {
  google::protobuf::Value v;
  auto st = google::protobuf::util::JsonStringToMessage(quoted, &v);
  EXPECT_TRUE(st.ok()) << quoted << ": " << st.ToString();
  EXPECT_EQ(v.kind_case(), google::protobuf::Value::kStringValue) << quoted;
  return v.string_value();
}

TEST(JsonQuoteTest, EscapesAndRoundTrips) {
  const std::string cases[] = {"",
                               "plain /dev/shm/shardps-1",
                               "quote \" backslash \\ slash /",
                               std::string("controls \n\t\r\b\f \x01\x1f and NUL \0 end", 33),
                               "utf-8: \xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80"};
  for (const std::string& s : cases) {
    const std::string q = JsonQuote(s);
    ASSERT_GE(q.size(), 2u);
    EXPECT_EQ(q.front(), '"');
    EXPECT_EQ(q.back(), '"');
    for (char c : q) EXPECT_GE(static_cast<unsigned char>(c), 0x20) << "raw control byte in " << q;
    EXPECT_EQ(RoundTrip(q), s);
  }
  EXPECT_EQ(JsonQuote("a\"b"), "\"a\\\"b\"");
  EXPECT_EQ(JsonQuote("a\\b"), "\"a\\\\b\"");
}

TEST(JsonQuoteTest, InvalidUtf8BecomesReplacementCharacter) {
  const std::string replacement = "\xEF\xBF\xBD";
  EXPECT_EQ(RoundTrip(JsonQuote("a\xff" "b")), "a" + replacement + "b");
  EXPECT_EQ(RoundTrip(JsonQuote("\xc3")), replacement);              // truncated sequence
  EXPECT_EQ(RoundTrip(JsonQuote("\xc0\xaf")), replacement + replacement);  // overlong '/'
  EXPECT_EQ(RoundTrip(JsonQuote("\xed\xa0\x80")), replacement + replacement + replacement);
}

}  // namespace
}  // namespace shardps::control
