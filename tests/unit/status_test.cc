#include "common/status.h"

#include <cerrno>

#include <gtest/gtest.h>

namespace shardps {
namespace {

StatusOr<int> Half(int x) {
  if (x % 2) return InvalidArgumentError("odd: " + std::to_string(x));
  return x / 2;
}

StatusOr<int> Quarter(int x) {
  ASSIGN_OR_RETURN(int h, Half(x));
  ASSIGN_OR_RETURN(int q, Half(h));
  return q;
}

Status CheckEven(int x) {
  RETURN_IF_ERROR(Half(x).status());
  return Status::OK();
}

TEST(StatusTest, OkHasNoMessage) {
  Status s;
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kOk);
  EXPECT_EQ(s.message(), "");
  EXPECT_EQ(s.ToString(), "OK");
}

TEST(StatusTest, ErrorCarriesCodeAndMessage) {
  Status s = NotFoundError("no such region");
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_EQ(s.ToString(), "NOT_FOUND: no such region");
  Status c = s.WithContext("connect");
  EXPECT_EQ(c.message(), "connect: no such region");
  EXPECT_EQ(c.code(), StatusCode::kNotFound);
  Status copy = c;
  EXPECT_EQ(copy, c);
}

TEST(StatusTest, ErrnoMapsToCodes) {
  EXPECT_EQ(ErrnoError("open", ENOENT).code(), StatusCode::kNotFound);
  EXPECT_EQ(ErrnoError("write", ENOSPC).code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(ErrnoError("connect", ECONNREFUSED).code(), StatusCode::kUnavailable);
  EXPECT_NE(ErrnoError("open", ENOENT).message().find("No such file"), std::string::npos);
}

TEST(StatusTest, MacrosPropagate) {
  EXPECT_EQ(*Quarter(8), 2);
  EXPECT_EQ(Quarter(6).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(Quarter(6).status().message(), "odd: 3");
  EXPECT_TRUE(CheckEven(4).ok());
  EXPECT_FALSE(CheckEven(5).ok());
}

}  // namespace
}  // namespace shardps
