// Unit test of the Python-free core (csrc/kvpush), built and run by csrc/tests/run.sh
// under AddressSanitizer and UBSan. No framework: CHECK records a failure and goes on;
// main returns nonzero if any check failed.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "kvpush/buffer_pool.hpp"
#include "kvpush/checksum.hpp"
#include "kvpush/completion.hpp"
#include "kvpush/plan.hpp"
#include "kvpush/status.hpp"

namespace {

int g_failures = 0;

template <class A, class B>
void check_eq(const A& a, const B& b, const char* expr_a, const char* expr_b, const char* file,
              int line) {
    if (a == b) return;
    std::ostringstream msg;
    msg << file << ":" << line << ": CHECK_EQ(" << expr_a << ", " << expr_b << ") failed: '"
        << a << "' != '" << b << "'\n";
    std::fputs(msg.str().c_str(), stderr);
    ++g_failures;
}

#define CHECK(cond)                                                                   \
    do {                                                                              \
        if (!(cond)) {                                                                \
            std::fprintf(stderr, "%s:%d: CHECK(%s) failed\n", __FILE__, __LINE__, #cond); \
            ++g_failures;                                                             \
        }                                                                             \
    } while (0)

#define CHECK_EQ(a, b) check_eq((a), (b), #a, #b, __FILE__, __LINE__)

using kvpush::Arrival;
using kvpush::BlockIdView;
using kvpush::CompletionTable;
using kvpush::check_link;
using kvpush::IdSetMethod;
using kvpush::LinkShape;
using kvpush::PlanRequest;
using kvpush::Status;
using kvpush::StatusCode;
using kvpush::TransferPlan;

const char* code_name(StatusCode code) {
    switch (code) {
        case StatusCode::Ok: return "Ok";
        case StatusCode::InvalidArgument: return "InvalidArgument";
        case StatusCode::OutOfRange: return "OutOfRange";
        case StatusCode::Duplicate: return "Duplicate";
        case StatusCode::LengthMismatch: return "LengthMismatch";
        case StatusCode::AlreadyExists: return "AlreadyExists";
        case StatusCode::NotFound: return "NotFound";
    }
    return "?";
}

// ------------------------------------------------------------------------------------
// plan_transfer

struct Plan {
    Status status;
    TransferPlan plan;
    std::vector<int32_t> local_indices;
    std::vector<int32_t> remote_indices;
};

template <class L, class R>
Plan make_plan(const std::vector<L>& local, const std::vector<R>& remote, int64_t local_blocks,
               int64_t remote_blocks, int64_t regions, bool coalesce,
               IdSetMethod method = IdSetMethod::Auto) {
    PlanRequest req;
    req.local_ids = BlockIdView::of(local.data(), local.size());
    req.remote_ids = BlockIdView::of(remote.data(), remote.size());
    req.local_num_blocks = local_blocks;
    req.remote_num_blocks = remote_blocks;
    req.num_regions = regions;
    req.coalesce = coalesce;
    Plan p;
    p.status = kvpush::plan_transfer(req, &p.plan, method);
    if (p.status.ok()) {
        p.local_indices.assign(p.plan.num_indices(), -1);
        p.remote_indices.assign(p.plan.num_indices(), -1);
        p.plan.write_indices(p.local_indices.data(), p.remote_indices.data());
    }
    return p;
}

// What a plan must be, computed the slow obvious way.
void check_against_naive(const std::vector<int64_t>& local, const std::vector<int64_t>& remote,
                         int64_t lb, int64_t rb, int64_t regions, bool coalesce,
                         IdSetMethod method) {
    const Plan p = make_plan(local, remote, lb, rb, regions, coalesce, method);
    CHECK(p.status.ok());
    if (!p.status.ok()) return;
    std::vector<std::pair<int64_t, int64_t>> pairs;
    for (std::size_t i = 0; i < local.size(); ++i) pairs.emplace_back(local[i], remote[i]);
    if (coalesce) std::sort(pairs.begin(), pairs.end());
    const std::size_t n = pairs.size();
    CHECK_EQ(p.plan.num_blocks(), static_cast<int64_t>(n));
    CHECK_EQ(p.local_indices.size(), n * static_cast<std::size_t>(regions));
    bool indices_ok = true;
    for (int64_t r = 0; r < regions; ++r) {
        for (std::size_t k = 0; k < n; ++k) {
            const std::size_t at = static_cast<std::size_t>(r) * n + k;
            indices_ok &= p.local_indices[at] == r * lb + pairs[k].first;
            indices_ok &= p.remote_indices[at] == r * rb + pairs[k].second;
        }
    }
    CHECK(indices_ok);
    std::vector<kvpush::Run> runs;
    for (std::size_t k = 0; k < n; ++k) {
        if (k > 0 && pairs[k].first == pairs[k - 1].first + 1 &&
            pairs[k].second == pairs[k - 1].second + 1) {
            ++runs.back().length;
        } else {
            runs.push_back({pairs[k].first, pairs[k].second, 1});
        }
    }
    CHECK_EQ(p.plan.runs.size(), runs.size());
    bool runs_ok = p.plan.runs.size() == runs.size();
    for (std::size_t i = 0; runs_ok && i < runs.size(); ++i) {
        runs_ok = p.plan.runs[i].local_start == runs[i].local_start &&
                  p.plan.runs[i].remote_start == runs[i].remote_start &&
                  p.plan.runs[i].length == runs[i].length;
    }
    CHECK(runs_ok);
    CHECK_EQ(p.plan.num_descriptors(true), static_cast<int64_t>(runs.size()) * regions);
    CHECK_EQ(p.plan.num_descriptors(false), static_cast<int64_t>(p.plan.num_indices()));
}

void test_plan_small_examples() {
    // Pairs (3,10) (1,8) (2,9) (7,0): sorted, 1..3 -> 8..10 is one run, 7 -> 0 another.
    const std::vector<int64_t> local{3, 1, 2, 7};
    const std::vector<int32_t> remote{10, 8, 9, 0};
    Plan p = make_plan(local, remote, 8, 16, 2, true);
    CHECK(p.status.ok());
    CHECK((p.local_indices == std::vector<int32_t>{1, 2, 3, 7, 9, 10, 11, 15}));
    CHECK((p.remote_indices == std::vector<int32_t>{8, 9, 10, 0, 24, 25, 26, 16}));
    CHECK_EQ(p.plan.num_runs(), 2);
    CHECK_EQ(p.plan.runs[0].local_start, 1);
    CHECK_EQ(p.plan.runs[0].remote_start, 8);
    CHECK_EQ(p.plan.runs[0].length, 3);
    CHECK_EQ(p.plan.num_descriptors(true), 4);
    CHECK_EQ(p.plan.num_descriptors(false), 8);  // a head shard: nothing merges

    // Without coalescing the given order stays; (1,8) (2,9) is still a run in that order.
    p = make_plan(local, remote, 8, 16, 2, false);
    CHECK(p.status.ok());
    CHECK((p.local_indices == std::vector<int32_t>{3, 1, 2, 7, 11, 9, 10, 15}));
    CHECK((p.remote_indices == std::vector<int32_t>{10, 8, 9, 0, 26, 24, 25, 16}));
    CHECK_EQ(p.plan.num_runs(), 3);

    // Empty requests are valid.
    p = make_plan(std::vector<int32_t>{}, std::vector<int64_t>{}, 4, 4, 3, true);
    CHECK(p.status.ok());
    CHECK_EQ(p.plan.num_runs(), 0);
    CHECK_EQ(p.plan.num_indices(), std::size_t{0});

    // The largest index space allowed: ids at the very top of int32.
    const int64_t top = std::numeric_limits<int32_t>::max();
    p = make_plan(std::vector<int64_t>{top - 1, top - 2}, std::vector<int64_t>{0, 1}, top, 2, 1,
                  true);
    CHECK(p.status.ok());
    CHECK((p.local_indices == std::vector<int32_t>{static_cast<int32_t>(top - 2),
                                                   static_cast<int32_t>(top - 1)}));
    CHECK_EQ(p.plan.num_runs(), 2);  // local rises, remote falls
}

void check_error(const Plan& p, StatusCode code, const std::string& message) {
    CHECK_EQ(code_name(p.status.code), code_name(code));
    CHECK_EQ(p.status.message, message);
}

void test_plan_errors() {
    using V = std::vector<int64_t>;
    check_error(make_plan(V{1, 2, 3}, V{1, 2, 3, 4}, 8, 8, 1, true), StatusCode::LengthMismatch,
                "local_ids and remote_ids differ in length: 3 != 4");
    check_error(make_plan(V{1}, V{1}, 8, 8, 0, true), StatusCode::InvalidArgument,
                "num_regions must be >= 1, got 0");
    check_error(make_plan(V{1}, V{1}, -3, 8, 1, true), StatusCode::InvalidArgument,
                "local_num_blocks must be >= 1, got -3");
    check_error(make_plan(V{1}, V{1}, 8, 0, 1, true), StatusCode::InvalidArgument,
                "remote_num_blocks must be >= 1, got 0");
    check_error(make_plan(V{1}, V{1}, 40000000, 8, 64, true), StatusCode::InvalidArgument,
                "num_regions * local_num_blocks = 64 * 40000000 does not fit in int32 "
                "descriptor indices");
    const int64_t max64 = std::numeric_limits<int64_t>::max();
    check_error(make_plan(V{1}, V{1}, 8, max64, max64, true), StatusCode::InvalidArgument,
                "num_regions * local_num_blocks = 9223372036854775807 * 8 does not fit in "
                "int32 descriptor indices");
    check_error(make_plan(V{0, 1, 2, 70}, V{0, 1, 2, 3}, 64, 64, 1, true), StatusCode::OutOfRange,
                "local_ids[3] = 70 is out of range [0, 64)");
    check_error(make_plan(V{0, 1, 2, 3}, V{0, -1, 2, 3}, 64, 64, 1, true),
                StatusCode::OutOfRange, "remote_ids[1] = -1 is out of range [0, 64)");
    // Range comes before duplicates, local before remote.
    check_error(make_plan(V{5, 5}, V{0, 99}, 64, 64, 1, true), StatusCode::OutOfRange,
                "remote_ids[1] = 99 is out of range [0, 64)");
    for (IdSetMethod method : {IdSetMethod::Bitmap, IdSetMethod::Sort}) {
        // 9 repeats at position 3 before 5 repeats at 4: the first repeat in array order.
        check_error(make_plan(V{5, 9, 1, 9, 5}, V{0, 1, 2, 3, 4}, 64, 64, 1, true, method),
                    StatusCode::Duplicate,
                    "local_ids has duplicate block id 9 (positions 1 and 3)");
        check_error(make_plan(V{0, 1, 2, 3, 4}, V{1, 5, 6, 7, 5}, 64, 64, 1, false, method),
                    StatusCode::Duplicate,
                    "remote_ids has duplicate block id 5 (positions 1 and 4)");
        check_error(make_plan(V{0, 0}, V{1, 1}, 64, 64, 1, false, method), StatusCode::Duplicate,
                    "local_ids has duplicate block id 0 (positions 0 and 1)");
    }
}

void test_check_block_ids() {
    using V = std::vector<int64_t>;
    const auto check = [](const V& ids, int64_t num_blocks, IdSetMethod method) {
        V out(ids.size(), -7);
        const Status s = kvpush::check_block_ids(BlockIdView::of(ids.data(), ids.size()),
                                                 "block_ids", num_blocks, out.data(), method);
        if (s.ok()) CHECK((out == ids));
        return s;
    };
    for (IdSetMethod method : {IdSetMethod::Auto, IdSetMethod::Bitmap, IdSetMethod::Sort}) {
        CHECK(check(V{}, 1, method).ok());
        CHECK(check(V{7, 0, 3}, 8, method).ok());
        Status s = check(V{0}, 0, method);
        CHECK_EQ(s.message, std::string("num_blocks must be >= 1, got 0"));
        s = check(V{0, 1, 2, 70}, 64, method);
        CHECK_EQ(code_name(s.code), code_name(StatusCode::OutOfRange));
        CHECK_EQ(s.message, std::string("block_ids[3] = 70 is out of range [0, 64)"));
        s = check(V{5, 5, -1}, 64, method);  // range before duplicates
        CHECK_EQ(s.message, std::string("block_ids[2] = -1 is out of range [0, 64)"));
        s = check(V{5, 9, 1, 9, 5}, 64, method);
        CHECK_EQ(code_name(s.code), code_name(StatusCode::Duplicate));
        CHECK_EQ(s.message, std::string("block_ids has duplicate block id 9 (positions 1 and 3)"));
    }
    // int32 ids are widened; the same checks apply.
    const std::vector<int32_t> narrow{3, 1, 3};
    V out(narrow.size());
    const Status s = kvpush::check_block_ids(BlockIdView::of(narrow.data(), narrow.size()),
                                             "ids", 4, out.data());
    CHECK_EQ(s.message, std::string("ids has duplicate block id 3 (positions 0 and 2)"));
}

void test_plan_matches_naive() {
    std::mt19937_64 rng(12345);
    for (int round = 0; round < 300; ++round) {
        const int64_t lb = 1 + static_cast<int64_t>(rng() % 300);
        const int64_t rb = 1 + static_cast<int64_t>(rng() % 300);
        const int64_t regions = 1 + static_cast<int64_t>(rng() % 5);
        const auto most = static_cast<uint64_t>(std::min(lb, rb));
        const auto n = static_cast<std::size_t>(rng() % (most + 1));
        std::vector<int64_t> local(static_cast<std::size_t>(lb));
        std::vector<int64_t> remote(static_cast<std::size_t>(rb));
        std::iota(local.begin(), local.end(), 0);
        std::iota(remote.begin(), remote.end(), 0);
        if (round % 3 == 0) {
            // Mostly-contiguous requests, which coalescing is for.
            const auto room = static_cast<uint64_t>(rb - static_cast<int64_t>(n) + 1);
            const auto shift = static_cast<int64_t>(rng() % room);
            std::shuffle(local.begin(), local.end(), rng);
            local.resize(n);
            std::sort(local.begin(), local.end());
            for (std::size_t i = 0; i < n; ++i) remote[i] = shift + static_cast<int64_t>(i);
            remote.resize(n);
            std::shuffle(local.begin(), local.end(), rng);
        } else {
            std::shuffle(local.begin(), local.end(), rng);
            std::shuffle(remote.begin(), remote.end(), rng);
            local.resize(n);
            remote.resize(n);
        }
        for (bool coalesce : {true, false}) {
            for (IdSetMethod m : {IdSetMethod::Auto, IdSetMethod::Bitmap, IdSetMethod::Sort}) {
                check_against_naive(local, remote, lb, rb, regions, coalesce, m);
            }
        }
    }
    // Sparse ids over a large space: Auto picks the sort there.
    std::vector<int64_t> local{1999999, 5, 123456, 6, 7};
    std::vector<int64_t> remote{0, 10, 20, 11, 12};
    check_against_naive(local, remote, 2000000, 100, 3, true, IdSetMethod::Auto);
    check_against_naive(local, remote, 2000000, 100, 3, false, IdSetMethod::Auto);
}

// ------------------------------------------------------------------------------------
// plan_split_transfer

struct SplitPlan {
    Status status;
    kvpush::SplitTransferPlan plan;
    std::vector<int32_t> local_indices;
    std::vector<int32_t> remote_indices;
};

struct SplitShape {
    int64_t local_blocks;
    int64_t remote_blocks;
    int64_t regions;
    int64_t heads;
    int64_t local_split;
    int64_t remote_split;
};

template <class L, class R>
SplitPlan make_split_plan(const std::vector<L>& local, const std::vector<R>& remote,
                          const SplitShape& shape, IdSetMethod method = IdSetMethod::Auto) {
    kvpush::SplitPlanRequest req;
    req.local_ids = BlockIdView::of(local.data(), local.size());
    req.remote_ids = BlockIdView::of(remote.data(), remote.size());
    req.local_num_blocks = shape.local_blocks;
    req.remote_num_blocks = shape.remote_blocks;
    req.num_regions = shape.regions;
    req.heads = shape.heads;
    req.local_split = shape.local_split;
    req.remote_split = shape.remote_split;
    SplitPlan p;
    p.status = kvpush::plan_split_transfer(req, &p.plan, method);
    if (p.status.ok()) {
        p.local_indices.assign(p.plan.num_indices(), -1);
        p.remote_indices.assign(p.plan.num_indices(), -1);
        p.plan.write_indices(p.local_indices.data(), p.remote_indices.data());
    }
    return p;
}

// What a split plan must be, from the definitions: descriptor ((r * blocks + b) * split +
// s) * heads + h, pair i at slot i % split of block ids[i / split]; runs over region 0.
void check_split_against_naive(const std::vector<int64_t>& local,
                               const std::vector<int64_t>& remote, const SplitShape& sh,
                               IdSetMethod method) {
    const SplitPlan p = make_split_plan(local, remote, sh, method);
    CHECK(p.status.ok());
    if (!p.status.ok()) return;
    const std::size_t n = sh.local_split > 1 ? remote.size() : local.size();
    auto desc = [&](const std::vector<int64_t>& ids, int64_t blocks, int64_t split, int64_t r,
                    std::size_t i, int64_t h) {
        const auto s = static_cast<std::size_t>(split);
        return ((r * blocks + ids[i / s]) * split + static_cast<int64_t>(i % s)) * sh.heads + h;
    };
    CHECK_EQ(p.plan.num_blocks(), static_cast<int64_t>(n));
    CHECK_EQ(p.local_indices.size(), n * static_cast<std::size_t>(sh.heads * sh.regions));
    bool indices_ok = p.local_indices.size() == n * static_cast<std::size_t>(sh.heads * sh.regions);
    std::size_t at = 0;
    for (int64_t r = 0; indices_ok && r < sh.regions; ++r) {
        for (std::size_t i = 0; i < n; ++i) {
            for (int64_t h = 0; h < sh.heads; ++h, ++at) {
                indices_ok &= p.local_indices[at] ==
                              desc(local, sh.local_blocks, sh.local_split, r, i, h);
                indices_ok &= p.remote_indices[at] ==
                              desc(remote, sh.remote_blocks, sh.remote_split, r, i, h);
            }
        }
    }
    CHECK(indices_ok);
    std::vector<kvpush::Run> runs;
    for (std::size_t k = 0; k < n * static_cast<std::size_t>(sh.heads); ++k) {
        const int64_t a = p.local_indices[k];
        const int64_t b = p.remote_indices[k];
        if (!runs.empty() && a == runs.back().local_start + runs.back().length &&
            b == runs.back().remote_start + runs.back().length) {
            ++runs.back().length;
        } else {
            runs.push_back({a, b, 1});
        }
    }
    CHECK_EQ(p.plan.runs.size(), runs.size());
    bool runs_ok = p.plan.runs.size() == runs.size();
    for (std::size_t i = 0; runs_ok && i < runs.size(); ++i) {
        runs_ok = p.plan.runs[i].local_start == runs[i].local_start &&
                  p.plan.runs[i].remote_start == runs[i].remote_start &&
                  p.plan.runs[i].length == runs[i].length;
    }
    CHECK(runs_ok);
    // Runs merge only where a coarse slot's heads are adjacent bytes (one head or no split).
    const bool heads_apart = std::max(sh.local_split, sh.remote_split) > 1 && sh.heads > 1;
    CHECK_EQ(p.plan.heads_apart, heads_apart);
    CHECK_EQ(p.plan.num_descriptors(true),
             heads_apart ? static_cast<int64_t>(p.plan.num_indices())
                         : static_cast<int64_t>(runs.size()) * sh.regions);
}

void check_split_error(const SplitPlan& p, StatusCode code, const std::string& message) {
    CHECK_EQ(code_name(p.status.code), code_name(code));
    CHECK_EQ(p.status.message, message);
}

void test_split_plan() {
    using V = std::vector<int64_t>;
    // Remote blocks hold two local blocks' tokens; 2 heads, 2 regions. Units: local
    // 5 6 7 2, remote (3,0) (3,1) (0,0) (0,1) = 6 7 0 1.
    const V local{5, 6, 7, 2};
    const std::vector<int32_t> remote{3, 0};
    SplitPlan p = make_split_plan(local, remote, SplitShape{8, 4, 2, 2, 1, 2});
    CHECK(p.status.ok());
    CHECK((p.local_indices ==
           std::vector<int32_t>{10, 11, 12, 13, 14, 15, 4, 5, 26, 27, 28, 29, 30, 31, 20, 21}));
    CHECK((p.remote_indices ==
           std::vector<int32_t>{12, 13, 14, 15, 0, 1, 2, 3, 28, 29, 30, 31, 16, 17, 18, 19}));
    CHECK_EQ(p.plan.num_runs(), 3);
    CHECK_EQ(p.plan.runs[0].local_start, 10);
    CHECK_EQ(p.plan.runs[0].remote_start, 12);
    CHECK_EQ(p.plan.runs[0].length, 4);
    // 2 heads, split 2: a slot's heads are not adjacent on the coarse side, so all 16
    // indices are descriptors of their own, though the index runs number 3 per region.
    CHECK_EQ(p.plan.num_descriptors(true), 16);

    // Mirrored, coarse side local, slot 1 of its block 0 unused.
    p = make_split_plan(remote, V{5, 6, 7}, SplitShape{4, 8, 1, 1, 2, 1});
    CHECK(p.status.ok());
    CHECK((p.local_indices == std::vector<int32_t>{6, 7, 0}));
    CHECK((p.remote_indices == std::vector<int32_t>{5, 6, 7}));
    CHECK_EQ(p.plan.num_runs(), 2);

    // Empty.
    p = make_split_plan(V{}, std::vector<int32_t>{}, SplitShape{4, 4, 3, 2, 3, 1});
    CHECK(p.status.ok());
    CHECK_EQ(p.plan.num_indices(), std::size_t{0});
    CHECK_EQ(p.plan.num_runs(), 0);

    // The top of the index space: 1 * INT32_MAX * 1 * 1 fits, heads = 2 does not.
    const int64_t top = std::numeric_limits<int32_t>::max();
    p = make_split_plan(V{top - 1, 0}, V{0}, SplitShape{top, 1, 1, 1, 1, 2});
    CHECK(p.status.ok());
    CHECK((p.local_indices == std::vector<int32_t>{static_cast<int32_t>(top - 1), 0}));
    CHECK((p.remote_indices == std::vector<int32_t>{0, 1}));

    // Both splits 1, one head: exactly plan_transfer without coalescing.
    const V l{3, 1, 2, 7};
    const V r{10, 8, 9, 0};
    p = make_split_plan(l, r, SplitShape{8, 16, 2, 1, 1, 1});
    const Plan plain = make_plan(l, r, 8, 16, 2, false);
    CHECK(p.local_indices == plain.local_indices);
    CHECK(p.remote_indices == plain.remote_indices);
    CHECK_EQ(p.plan.num_runs(), plain.plan.num_runs());

    // Errors, in order.
    const V two{0, 1};
    const V one{0};
    check_split_error(make_split_plan(two, one, SplitShape{8, 8, 0, 1, 1, 2}),
                      StatusCode::InvalidArgument, "num_regions must be >= 1, got 0");
    check_split_error(make_split_plan(two, one, SplitShape{0, 8, 1, 0, 1, 2}),
                      StatusCode::InvalidArgument, "local_num_blocks must be >= 1, got 0");
    check_split_error(make_split_plan(two, one, SplitShape{8, 8, 1, 0, 1, 2}),
                      StatusCode::InvalidArgument, "heads must be >= 1, got 0");
    check_split_error(make_split_plan(two, one, SplitShape{8, 8, 1, 1, 1, -1}),
                      StatusCode::InvalidArgument, "remote_split must be >= 1, got -1");
    check_split_error(make_split_plan(two, one, SplitShape{8, 8, 1, 1, 2, 3}),
                      StatusCode::InvalidArgument,
                      "local_split and remote_split cannot both exceed 1, got 2 and 3");
    check_split_error(make_split_plan(V{0, 1, 2, 3, 4}, two, SplitShape{8, 8, 1, 1, 1, 2}),
                      StatusCode::LengthMismatch,
                      "remote_ids has 2 entries, but 5 local_ids at remote_split = 2 need "
                      "ceil(5 / 2) = 3");
    CHECK(make_split_plan(V{0, 1, 2, 3, 4}, two, SplitShape{8, 8, 1, 1, 1, 3}).status.ok());
    check_split_error(make_split_plan(two, V{0, 1, 2}, SplitShape{8, 8, 1, 1, 4, 1}),
                      StatusCode::LengthMismatch,
                      "local_ids has 2 entries, but 3 remote_ids at local_split = 4 need "
                      "ceil(3 / 4) = 1");
    const int64_t max64 = std::numeric_limits<int64_t>::max();
    check_split_error(make_split_plan(one, one, SplitShape{8, 8, 1, max64, 1, 1}),
                      StatusCode::InvalidArgument,
                      "num_regions * local_num_blocks * local_split * heads = 1 * 8 * 1 * "
                      "9223372036854775807 does not fit in int32 descriptor indices");
    check_split_error(make_split_plan(two, one, SplitShape{8, int64_t{1} << 28, 1, 1, 1, 8}),
                      StatusCode::InvalidArgument,
                      "num_regions * remote_num_blocks * remote_split * heads = 1 * 268435456 "
                      "* 8 * 1 does not fit in int32 descriptor indices");
    check_split_error(make_split_plan(V{0, 8}, one, SplitShape{8, 8, 1, 1, 1, 2}),
                      StatusCode::OutOfRange, "local_ids[1] = 8 is out of range [0, 8)");
    check_split_error(make_split_plan(V{5, 5}, V{99}, SplitShape{8, 8, 1, 1, 1, 2}),
                      StatusCode::OutOfRange, "remote_ids[0] = 99 is out of range [0, 8)");
    for (IdSetMethod method : {IdSetMethod::Bitmap, IdSetMethod::Sort}) {
        check_split_error(
            make_split_plan(V{5, 9, 1, 9, 5}, V{0, 1, 2}, SplitShape{64, 64, 1, 1, 1, 2}, method),
            StatusCode::Duplicate, "local_ids has duplicate block id 9 (positions 1 and 3)");
        check_split_error(
            make_split_plan(V{0, 1, 2, 3, 4}, V{4, 2, 4}, SplitShape{64, 64, 1, 1, 1, 2}, method),
            StatusCode::Duplicate, "remote_ids has duplicate block id 4 (positions 0 and 2)");
    }

    // Random requests against the definitions, coarse side local or remote.
    std::mt19937_64 rng(777);
    for (int round = 0; round < 200; ++round) {
        const auto k = 1 + static_cast<int64_t>(rng() % 8);
        const auto heads = 1 + static_cast<int64_t>(rng() % 8);
        const auto regions = 1 + static_cast<int64_t>(rng() % 4);
        const auto n = static_cast<std::size_t>(rng() % 41);
        const std::size_t m = (n + static_cast<std::size_t>(k) - 1) / static_cast<std::size_t>(k);
        const auto fine_blocks = static_cast<int64_t>(n) + 1 + static_cast<int64_t>(rng() % 50);
        const auto coarse_blocks = static_cast<int64_t>(m) + 1 + static_cast<int64_t>(rng() % 50);
        V fine(static_cast<std::size_t>(fine_blocks));
        V coarse(static_cast<std::size_t>(coarse_blocks));
        std::iota(fine.begin(), fine.end(), 0);
        std::iota(coarse.begin(), coarse.end(), 0);
        if (round % 3 != 0) {  // else consecutive ids, which make long runs
            std::shuffle(fine.begin(), fine.end(), rng);
            std::shuffle(coarse.begin(), coarse.end(), rng);
        }
        fine.resize(n);
        coarse.resize(m);
        const bool local_coarse = round % 2 == 0;
        for (IdSetMethod method : {IdSetMethod::Auto, IdSetMethod::Bitmap, IdSetMethod::Sort}) {
            if (local_coarse) {
                check_split_against_naive(
                    coarse, fine, SplitShape{coarse_blocks, fine_blocks, regions, heads, k, 1},
                    method);
            } else {
                check_split_against_naive(
                    fine, coarse, SplitShape{fine_blocks, coarse_blocks, regions, heads, 1, k},
                    method);
            }
        }
    }
}

// ------------------------------------------------------------------------------------
// CompletionTable

void test_completion_basics() {
    CompletionTable t;
    CHECK(t.expect("a", 3).ok());
    CHECK_EQ(code_name(t.expect("a", 2).code), code_name(StatusCode::AlreadyExists));
    CHECK_EQ(t.expect("a", 2).message, std::string("completion key 'a' is already expected"));
    CHECK_EQ(t.expect("b", 0).message, std::string("parts must be in [1, 16777216], got 0"));
    CHECK_EQ(code_name(t.expect("b", CompletionTable::kMaxParts + 1).code),
             code_name(StatusCode::InvalidArgument));
    CHECK(!t.contains("b"));
    CHECK(t.arrive("a", 1) == Arrival::Pending);
    CHECK(t.arrive("a", 1) == Arrival::Duplicate);
    CHECK(t.arrive("a", 3) == Arrival::OutOfRange);
    CHECK(t.arrive("a", -1) == Arrival::OutOfRange);
    CHECK(t.arrive("zzz", 0) == Arrival::Unknown);
    CHECK(t.arrive("a", 0) == Arrival::Pending);
    CHECK_EQ(t.progress("a")->arrived, 2);
    CHECK(t.arrive("a", 2) == Arrival::Complete);
    CHECK(t.arrive("a", 2) == Arrival::Duplicate);
    CHECK(t.arrive("a", 0) == Arrival::Duplicate);
    CHECK_EQ(t.progress("a")->arrived, 3);
    CHECK_EQ(t.progress("a")->expected, 3);
    CHECK(!t.progress("b").has_value());
    CHECK_EQ(t.size(), std::size_t{1});
    CHECK(t.remove("a"));
    CHECK(!t.remove("a"));
    CHECK(t.arrive("a", 0) == Arrival::Unknown);
    CHECK_EQ(t.size(), std::size_t{0});

    // Many parts span several bitset words; keys may hold any bytes.
    const std::string key("k\0ey", 4);
    CHECK(t.expect(key, 64 * 8 + 3).ok());
    for (int64_t part = 64 * 8 + 2; part > 0; --part) {
        CHECK(t.arrive(key, part) == Arrival::Pending);
    }
    CHECK(!t.contains("k"));
    CHECK(t.arrive(key, 0) == Arrival::Complete);
}

void test_completion_threads() {
    // Each of kThreads threads delivers every part of every key once (so each part kThreads
    // times, interleaved); exactly one Complete per key must come out, and the totals add up.
    constexpr int kThreads = 8;
    constexpr int kKeys = 64;
    constexpr int kParts = 100;
    CompletionTable t;
    for (int k = 0; k < kKeys; ++k) CHECK(t.expect("key" + std::to_string(k), kParts).ok());
    std::atomic<int> complete{0};
    std::atomic<int> pending{0};
    std::atomic<int> duplicate{0};
    std::atomic<int> other{0};
    std::vector<std::thread> threads;
    for (int i = 0; i < kThreads; ++i) {
        threads.emplace_back([&, i] {
            std::mt19937 rng(static_cast<unsigned>(i));
            std::vector<std::pair<int, int>> work;
            for (int k = 0; k < kKeys; ++k) {
                for (int p = 0; p < kParts; ++p) work.emplace_back(k, p);
            }
            std::shuffle(work.begin(), work.end(), rng);
            for (const auto& [k, p] : work) {
                switch (t.arrive("key" + std::to_string(k), p)) {
                    case Arrival::Complete: ++complete; break;
                    case Arrival::Pending: ++pending; break;
                    case Arrival::Duplicate: ++duplicate; break;
                    default: ++other; break;
                }
                if (p % 50 == 0) (void)t.progress("key" + std::to_string(k));
            }
        });
    }
    for (auto& th : threads) th.join();
    CHECK_EQ(complete.load(), kKeys);
    CHECK_EQ(pending.load(), kKeys * (kParts - 1));
    CHECK_EQ(duplicate.load(), kKeys * kParts * (kThreads - 1));
    CHECK_EQ(other.load(), 0);
}

// ------------------------------------------------------------------------------------
// block_checksums

// The hash as checksum.hpp defines it, one byte at a time, without lanes unrolled.
uint64_t naive_checksum(const std::vector<const unsigned char*>& blocks, std::size_t block_bytes) {
    const auto rotl = [](uint64_t x, int r) { return (x << r) | (x >> (64 - r)); };
    const auto round = [&](uint64_t v, uint64_t w) {
        return rotl(v + w * kvpush::kChecksumMul2, 31) * kvpush::kChecksumMul1;
    };
    uint64_t lanes[4];
    for (int j = 0; j < 4; ++j) {
        lanes[j] = kvpush::kChecksumSeed + static_cast<uint64_t>(j) * kvpush::kChecksumMul2;
    }
    for (const unsigned char* block : blocks) {
        const std::size_t words = (block_bytes + 7) / 8;
        for (std::size_t k = 0; k < words; ++k) {
            uint64_t w = 0;
            for (std::size_t byte = 0; byte < 8; ++byte) {
                const std::size_t at = 8 * k + byte;
                if (at < block_bytes) w |= static_cast<uint64_t>(block[at]) << (8 * byte);
            }
            lanes[k % 4] = round(lanes[k % 4], w);
        }
    }
    uint64_t h = static_cast<uint64_t>(blocks.size()) * block_bytes * kvpush::kChecksumMul1;
    for (uint64_t lane : lanes) h = round(h, lane);
    h ^= h >> 32;
    h *= kvpush::kChecksumMul2;
    h ^= h >> 29;
    h *= kvpush::kChecksumMul1;
    h ^= h >> 32;
    return h;
}

struct Cache {
    std::vector<std::vector<unsigned char>> regions;
    std::vector<uint64_t> bases;
};

Cache make_cache(std::size_t num_regions, std::size_t num_blocks, std::size_t stride,
                 std::mt19937_64& rng) {
    Cache c;
    for (std::size_t r = 0; r < num_regions; ++r) {
        std::vector<unsigned char> bytes(num_blocks * stride);
        for (auto& b : bytes) b = static_cast<unsigned char>(rng());
        c.regions.push_back(std::move(bytes));
    }
    for (auto& region : c.regions) c.bases.push_back(reinterpret_cast<uint64_t>(region.data()));
    return c;
}

Status checksums(const Cache& c, int64_t stride, int64_t bytes, const std::vector<int64_t>& ids,
                 int64_t num_blocks, std::vector<uint64_t>* out) {
    kvpush::ChecksumRequest req;
    req.base_addresses = c.bases.data();
    req.num_regions = c.bases.size();
    req.block_stride = stride;
    req.block_bytes = bytes;
    req.block_ids = BlockIdView::of(ids.data(), ids.size());
    req.num_blocks = num_blocks;
    out->assign(ids.size(), 0);
    return kvpush::block_checksums(req, out->data());
}

void test_checksums() {
    std::mt19937_64 rng(7);
    for (std::size_t block_bytes : {1, 7, 8, 9, 24, 31, 32, 33, 64, 100, 4096}) {
        const std::size_t stride = block_bytes + (block_bytes % 3);
        const std::size_t num_blocks = 5;
        Cache c = make_cache(3, num_blocks, stride, rng);
        // Cut the last region right after block 4's bytes, so ASan flags any read past them.
        c.regions[2] = std::vector<unsigned char>(c.regions[2].begin(),
                                                  c.regions[2].begin() + 4 * stride + block_bytes);
        c.bases[2] = reinterpret_cast<uint64_t>(c.regions[2].data());
        const std::vector<int64_t> ids{4, 0, 2, 2, 1};
        std::vector<uint64_t> got;
        CHECK(checksums(c, static_cast<int64_t>(stride), static_cast<int64_t>(block_bytes), ids,
                        num_blocks, &got)
                  .ok());
        for (std::size_t i = 0; i < ids.size(); ++i) {
            std::vector<const unsigned char*> blocks;
            for (const auto& region : c.regions) {
                blocks.push_back(region.data() + static_cast<std::size_t>(ids[i]) * stride);
            }
            CHECK_EQ(got[i], naive_checksum(blocks, block_bytes));
        }
        CHECK_EQ(got[2], got[3]);
        CHECK(got[0] != got[1]);

        // One flipped bit changes that block's checksum only.
        c.regions[1][2 * stride + block_bytes - 1] ^= 0x10;
        std::vector<uint64_t> flipped;
        CHECK(checksums(c, static_cast<int64_t>(stride), static_cast<int64_t>(block_bytes), ids,
                        num_blocks, &flipped)
                  .ok());
        CHECK(flipped[2] != got[2]);
        CHECK_EQ(flipped[0], got[0]);
        CHECK_EQ(flipped[4], got[4]);
        // Bytes between block_bytes and stride are not part of the block.
        if (stride > block_bytes) {
            c.regions[0][block_bytes] ^= 0xff;
            CHECK(checksums(c, static_cast<int64_t>(stride), static_cast<int64_t>(block_bytes),
                            ids, num_blocks, &flipped)
                      .ok());
            CHECK_EQ(flipped[1], got[1]);
        }
        // Region order matters.
        std::swap(c.bases[0], c.bases[1]);
        CHECK(checksums(c, static_cast<int64_t>(stride), static_cast<int64_t>(block_bytes), ids,
                        num_blocks, &flipped)
                  .ok());
        CHECK(flipped[0] != got[0]);
    }

    // Errors, in order.
    Cache c = make_cache(1, 4, 16, rng);
    std::vector<uint64_t> out;
    const std::vector<int64_t> ids{0, 3};
    Cache none;
    CHECK_EQ(checksums(none, 16, 16, ids, 4, &out).message,
             std::string("base_addresses is empty: need at least one region"));
    CHECK_EQ(checksums(c, 16, 0, ids, 4, &out).message,
             std::string("block_bytes must be >= 1, got 0"));
    CHECK_EQ(checksums(c, 8, 16, ids, 4, &out).message,
             std::string("block_stride must be >= block_bytes, got 8 < 16"));
    CHECK_EQ(checksums(c, 16, 16, ids, 0, &out).message,
             std::string("num_blocks must be >= 1, got 0"));
    CHECK_EQ(checksums(c, int64_t{1} << 62, 16, ids, 4, &out).message,
             std::string("num_blocks * block_stride = 4 * 4611686018427387904 does not fit in "
                         "int64 byte offsets"));
    CHECK_EQ(checksums(c, 16, 16, std::vector<int64_t>{0, 4}, 4, &out).message,
             std::string("block_ids[1] = 4 is out of range [0, 4)"));
    CHECK(checksums(c, 16, 16, std::vector<int64_t>{}, 4, &out).ok());
}

}  // namespace

void test_buffer_pool() {
    kvpush::BufferPool pool(2, 1 << 20);
    std::size_t cap_a = 0;
    std::size_t cap_b = 0;
    int32_t* a = pool.acquire(1000, &cap_a);
    CHECK(a != nullptr);
    CHECK(cap_a >= 1000);
    a[0] = 1;
    a[999] = 2;  // the whole capacity is writable (ASan checks)
    pool.release(a, cap_a);
    CHECK_EQ(pool.cached(), std::size_t{1});
    // Reused for the same size, and for up to twice smaller.
    int32_t* b = pool.acquire(600, &cap_b);
    CHECK(b == a);
    CHECK_EQ(cap_b, cap_a);
    CHECK_EQ(pool.cached(), std::size_t{0});
    // Not reused for a request less than half its size, nor for a larger one.
    pool.release(b, cap_b);
    std::size_t cap_c = 0;
    int32_t* c = pool.acquire(100, &cap_c);
    CHECK(c != b);
    std::size_t cap_d = 0;
    int32_t* d = pool.acquire(2000, &cap_d);
    CHECK(d != b);
    CHECK(cap_d >= 2000);
    // At most two cached: releasing three keeps the two most recent.
    pool.release(c, cap_c);
    pool.release(d, cap_d);
    CHECK_EQ(pool.cached(), std::size_t{2});
    std::size_t cap_e = 0;
    int32_t* e = pool.acquire(2000, &cap_e);
    CHECK(e == d);
    pool.release(e, cap_e);
    // Too large for the byte budget: freed, not cached.
    std::size_t cap_f = 0;
    int32_t* f = pool.acquire(1 << 19, &cap_f);
    pool.release(f, cap_f);
    CHECK(pool.cached() <= std::size_t{2});
    pool.release(nullptr, 0);
    // A zero-size request still gets a buffer. The pool frees what it caches (LSan).
    std::size_t cap_g = 0;
    int32_t* g = pool.acquire(0, &cap_g);
    CHECK(g != nullptr);
    pool.release(g, cap_g);
}

void test_check_link() {
    // A link's constants, checked once at handshake, with the plan functions' messages.
    LinkShape shape;
    shape.local_num_blocks = 8;
    shape.remote_num_blocks = 16;
    shape.num_regions = 4;
    CHECK(check_link(shape).ok());
    shape.heads = 2;
    shape.remote_split = 2;
    CHECK(shape.split());
    CHECK(check_link(shape).ok());
    shape.local_split = 2;
    Status s = check_link(shape);
    CHECK_EQ(code_name(s.code), code_name(StatusCode::InvalidArgument));
    CHECK_EQ(s.message, std::string("local_split and remote_split cannot both exceed 1, got 2 "
                                    "and 2"));
    shape = LinkShape{};
    shape.local_num_blocks = 8;
    shape.remote_num_blocks = 8;
    shape.num_regions = 1;
    shape.local_split = 3;  // splits without heads
    s = check_link(shape);
    CHECK_EQ(s.message, std::string("a link without heads has splits 1, got 3 and 1"));
    shape.local_split = 1;
    shape.num_regions = 4;
    shape.local_num_blocks = int64_t{1} << 30;  // 4 * 2^30 indices do not fit int32
    s = check_link(shape);
    CHECK_EQ(s.message, std::string("num_regions * local_num_blocks = 4 * 1073741824 does not "
                                    "fit in int32 descriptor indices"));
    shape.local_num_blocks = 0;
    CHECK_EQ(check_link(shape).message, std::string("local_num_blocks must be >= 1, got 0"));
}

int main() {
    test_buffer_pool();
    test_check_link();
    test_plan_small_examples();
    test_plan_errors();
    test_check_block_ids();
    test_plan_matches_naive();
    test_split_plan();
    test_completion_basics();
    test_completion_threads();
    test_checksums();
    if (g_failures != 0) {
        std::fprintf(stderr, "test_core: %d check(s) failed\n", g_failures);
        return 1;
    }
    std::puts("test_core: all checks passed");
    return 0;
}
