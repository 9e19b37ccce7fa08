#include "server/worker_table.h"

#include <gtest/gtest.h>

namespace shardps::server {
namespace {

TEST(WorkerTableTest, ExactlyOncePerWorkerAndSlot) {
  WorkerTable t(2);
  bool fresh = false;
  EXPECT_FALSE(t.Hello(0, 7, 11, &fresh));
  EXPECT_TRUE(fresh);
  EXPECT_FALSE(t.IsDuplicate(0, 0, 1));
  t.Consume(0, 0, 1, 0);
  EXPECT_TRUE(t.IsDuplicate(0, 0, 1));
  EXPECT_FALSE(t.IsDuplicate(0, 0, 2));
  EXPECT_FALSE(t.IsDuplicate(0, 1, 1));  // slots are independent
  t.Consume(0, 0, 2, -1);                // a stale BSP push records no clock
  EXPECT_EQ(t.Find(0)->last_seq[0], 2u);
  EXPECT_EQ(t.Find(0)->applied_clock[0], 0);
  EXPECT_EQ(t.Find(0)->endpoint_id, 11u);
}

TEST(WorkerTableTest, SameIncarnationKeepsSequenceNumbersANewOneStartsFresh) {
  WorkerTable t(1);
  bool fresh = false;
  t.Hello(3, 100, 1, &fresh);
  t.Consume(3, 0, 5, 2);
  // Reconnect of the same process: keeps its state, acks are not reset.
  EXPECT_TRUE(t.Hello(3, 100, 2, &fresh));
  EXPECT_FALSE(fresh);
  EXPECT_TRUE(t.IsDuplicate(3, 0, 5));
  EXPECT_EQ(t.Find(3)->endpoint_id, 2u);
  // A restarted worker (new member id): fresh state.
  EXPECT_FALSE(t.Hello(3, 101, 3, &fresh));
  EXPECT_TRUE(fresh);
  EXPECT_FALSE(t.IsDuplicate(3, 0, 1));
  EXPECT_EQ(t.Find(3)->applied_clock[0], -1);
  // An old client without an incarnation: every hello starts fresh sequence state.
  t.Hello(4, 0, 4, &fresh);
  t.Consume(4, 0, 9, 1);
  t.Hello(4, 0, 5, &fresh);
  EXPECT_FALSE(fresh);
  EXPECT_FALSE(t.IsDuplicate(4, 0, 9));
}

TEST(WorkerTableTest, ReplicatedFoldsIgnoreOlderIncarnationsAndNeverGoBack) {
  WorkerTable t(1);
  bool fresh = false;
  EXPECT_TRUE(t.FoldReplicated(1, 20, 0, 4, 3, &fresh));
  EXPECT_TRUE(fresh);
  EXPECT_TRUE(t.FoldReplicated(1, 20, 0, 2, 1, &fresh));  // an older seq: no step back
  EXPECT_FALSE(fresh);
  EXPECT_EQ(t.Find(1)->last_seq[0], 4u);
  EXPECT_EQ(t.Find(1)->applied_clock[0], 3);
  EXPECT_FALSE(t.FoldReplicated(1, 19, 0, 9, 9, &fresh));  // an older process's push
  EXPECT_EQ(t.Find(1)->last_seq[0], 4u);
  EXPECT_TRUE(t.FoldReplicated(1, 21, 0, 1, 0, &fresh));  // the restarted process
  EXPECT_TRUE(fresh);
  EXPECT_EQ(t.Find(1)->last_seq[0], 1u);
}

TEST(WorkerTableTest, ClockImmediatesCarryTheLow28Bits) {
  WorkerTable t(1);
  EXPECT_FALSE(t.AdvanceClock(0, 1));  // unknown worker
  bool fresh = false;
  t.Hello(0, 1, 1, &fresh);
  EXPECT_TRUE(t.AdvanceClock(0, 1));
  EXPECT_FALSE(t.AdvanceClock(0, 1));  // repeated
  EXPECT_EQ(t.Find(0)->clock, 1u);
  EXPECT_TRUE(t.AdvanceClock(0, 5000));  // a reconnect sends its whole clock
  EXPECT_EQ(t.Find(0)->clock, 5000u);
  EXPECT_FALSE(t.AdvanceClock(0, 4999));  // stale
  t.Find(0)->clock = 0x0fffffff;
  EXPECT_TRUE(t.AdvanceClock(0, 0));  // wraps past 2^28
  EXPECT_EQ(t.Find(0)->clock, 0x10000000u);
}

TEST(WorkerTableTest, LiveWorkersFollowMembershipAndDepartures) {
  WorkerTable t(1);
  EXPECT_TRUE(t.SetMembers({0, 1, 2}).empty());
  bool fresh = false;
  t.Hello(5, 1, 1, &fresh);  // known, not (yet) a member: live
  EXPECT_EQ(t.Live(), (std::set<uint32_t>{0, 1, 2, 5}));
  EXPECT_EQ(t.SetMembers({0, 2}), std::vector<uint32_t>{1});
  EXPECT_EQ(t.Live(), (std::set<uint32_t>{0, 2, 5}));
  t.Hello(1, 2, 2, &fresh);  // came back
  EXPECT_EQ(t.Live(), (std::set<uint32_t>{0, 1, 2, 5}));
  EXPECT_EQ(t.most_members_seen(), 3u);
}

// A departed process's late hello (its endpoint accepted before the departure, its hello polled
// after) does not make it live again: the coordinator let it go, and every BSP clock would wait
// for it for good (found by review, 2026-12-07). A membership naming the rank, or a new
// process of the rank, does.
TEST(WorkerTableTest, ADepartedProcesssLateHelloDoesNotMakeItLive) {
  WorkerTable t(1);
  bool fresh = false;
  t.SetMembers({0, 1});
  t.Hello(0, 10, 1, &fresh);
  t.Hello(1, 11, 2, &fresh);
  EXPECT_EQ(t.SetMembers({0}), std::vector<uint32_t>{1});
  t.Hello(1, 11, 3, &fresh);  // the same process, on an endpoint accepted before it left
  EXPECT_EQ(t.Live(), (std::set<uint32_t>{0})) << "the departed process is not waited for";
  t.SetMembers({0, 1});  // readmitted
  EXPECT_EQ(t.Live(), (std::set<uint32_t>{0, 1}));
  t.SetMembers({0});
  t.Hello(1, 12, 4, &fresh);  // a new process of rank 1: live at once (its membership follows)
  EXPECT_EQ(t.Live(), (std::set<uint32_t>{0, 1}));
}

}  // namespace
}  // namespace shardps::server
