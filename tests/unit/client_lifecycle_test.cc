// The client's state machine (worker/client_lifecycle.h) without a network: transitions, and
// refusals that name the call, the state and the cause.
#include "worker/client_lifecycle.h"

#include <gtest/gtest.h>

namespace shardps::worker {
namespace {

constexpr auto kJoined = ClientState::kJoined;
constexpr auto kRunning = ClientState::kRunning;

TEST(ClientLifecycleTest, RefusalNamesTheCallAndTheState) {
  ClientLifecycle l;
  EXPECT_EQ(l.state(), kJoined);
  EXPECT_TRUE(l.Require("RegisterTensor()", {kJoined}).ok());
  Status s = l.Require("Clock()", {kRunning});
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.message(), "Clock() before Start()");
}

TEST(ClientLifecycleTest, StartSucceedsOrFailsForGood) {
  ClientLifecycle ok;
  ok.BeginStart();
  EXPECT_EQ(ok.state(), ClientState::kStarting);
  EXPECT_TRUE(ok.FinishStart(Status::OK()).ok());
  EXPECT_EQ(ok.state(), kRunning);
  EXPECT_EQ(ok.Require("Start()", {kJoined}).message(), "Start() after Start()");

  ClientLifecycle failed;
  failed.BeginStart();
  const Status why = DeadlineExceededError("waiting for 2 workers to join");
  EXPECT_EQ(failed.FinishStart(why), why);  // Start's own error is returned as it is
  EXPECT_EQ(failed.state(), ClientState::kStartFailed);
  const Status s = failed.Require("Pull()", {kRunning});
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.message(),
            "Pull() after a failed Start() (DEADLINE_EXCEEDED: waiting for 2 workers to join)");
}

TEST(ClientLifecycleTest, OnlyARunningClientBreaks) {
  ClientLifecycle l;
  const Status cause = UnavailableError("server rank 1: failed, and the cluster has no backups");
  EXPECT_EQ(l.Break(cause), cause);
  EXPECT_EQ(l.state(), kJoined);  // a failure inside Start is Start's error
  l.BeginStart();
  ASSERT_TRUE(l.FinishStart(Status::OK()).ok());
  EXPECT_TRUE(l.Break(Status::OK()).ok());
  EXPECT_EQ(l.state(), kRunning);  // OK breaks nothing
  EXPECT_EQ(l.Break(cause), cause);
  EXPECT_EQ(l.state(), ClientState::kBroken);
  const Status s = l.Require("Step()", {kRunning});
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("Step() after an unrecoverable data-path error"), std::string::npos);
  EXPECT_NE(s.message().find(cause.message()), std::string::npos) << s;
}

TEST(ClientLifecycleTest, CloseFromEveryStateOnce) {
  for (int variant = 0; variant < 4; ++variant) {
    ClientLifecycle l;
    if (variant >= 1) l.BeginStart();
    if (variant == 2) l.FinishStart(Status::OK()).IgnoreError();
    if (variant == 3) l.FinishStart(InternalError("x")).IgnoreError();
    EXPECT_TRUE(l.Close());
    EXPECT_FALSE(l.Close());
    EXPECT_EQ(l.state(), ClientState::kClosed);
    EXPECT_EQ(l.Require("Push()", {kRunning}).code(), StatusCode::kFailedPrecondition);
    EXPECT_EQ(l.Require("Push()", {kRunning}).message().rfind("Push() after Close()", 0), 0u);
  }
}

}  // namespace
}  // namespace shardps::worker
