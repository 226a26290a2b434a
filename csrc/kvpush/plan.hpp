// Block-id mapping and coalescing: turns a request "move local block local_ids[i] to
// remote block remote_ids[i] in every region" into the two int32 descriptor-index lists
// that NIXL's make_prepped_xfer takes.
//
// Each side's descriptor list is prepared once, region-major, so the descriptor of
// (region r, block b) is r * side_num_blocks + b. Coalescing orders the pairs so that
// blocks adjacent on both sides get adjacent descriptor indices; NIXL then merges them
// into one larger transfer, which is what makes scattered KV blocks fast to move.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvpush/status.hpp"

namespace kvpush {

// A borrowed, read-only view of caller-owned block ids, int32 or int64.
struct BlockIdView {
    const void* data = nullptr;
    std::size_t size = 0;
    bool is_int64 = false;

    static BlockIdView of(const int32_t* p, std::size_t n) { return {p, n, false}; }
    static BlockIdView of(const int64_t* p, std::size_t n) { return {p, n, true}; }
};

// Copies `ids` into `out`, checking each against [0, num_blocks). Every id is read
// exactly once: the bindings call the core without the GIL, so another thread may write
// to the buffer meanwhile, and everything after the check must use the checked copy.
// `name` appears in the message, e.g. "local_ids[3] = 70 is out of range [0, 64)".
Status copy_block_ids(const BlockIdView& ids, const char* name, int64_t num_blocks,
                      std::vector<int64_t>* out);

struct PlanRequest {
    BlockIdView local_ids;
    BlockIdView remote_ids;
    int64_t local_num_blocks = 0;
    int64_t remote_num_blocks = 0;
    int64_t num_regions = 0;
    bool coalesce = true;
};

// A stretch of `length` blocks that are consecutive on both sides.
struct Run {
    int64_t local_start;
    int64_t remote_start;
    int64_t length;
};

// A validated, ordered request. Compact (O(n)): the per-region descriptor index lists
// are written on demand by write_indices, straight into the caller's buffers.
struct TransferPlan {
    // Pair k moves local block local_blocks[k] to remote block remote_blocks[k], in every
    // region; k runs in emitted order (sorted by local id when coalescing).
    std::vector<int32_t> local_blocks;
    std::vector<int32_t> remote_blocks;
    // Maximal runs of pairs that advance by one on both sides, in emitted order.
    std::vector<Run> runs;
    int64_t local_num_blocks = 0;
    int64_t remote_num_blocks = 0;
    int64_t num_regions = 0;

    int64_t num_blocks() const { return static_cast<int64_t>(local_blocks.size()); }
    int64_t num_runs() const { return static_cast<int64_t>(runs.size()); }
    // Descriptors NIXL moves. `merges`: adjacent descriptor indices are adjacent bytes on
    // both sides (whole blocks, no padding), so NIXL merges each run into one; otherwise
    // (a head shard of each block, padded blocks) every index is a descriptor of its own.
    int64_t num_descriptors(bool merges) const {
        return merges ? num_runs() * num_regions : static_cast<int64_t>(num_indices());
    }
    // Length of each descriptor index list: n * num_regions (<= INT32_MAX once validated).
    std::size_t num_indices() const {
        return local_blocks.size() * static_cast<std::size_t>(num_regions);
    }
    // Writes the two region-major lists NIXL's make_prepped_xfer takes: entry r * n + k is
    // r * side_num_blocks + side_blocks[k]. Each buffer must hold num_indices() entries.
    void write_indices(int32_t* local_out, int32_t* remote_out) const;
};

// How duplicate block ids are found (and, with coalescing, how pairs are ordered).
// Bitmap is O(n + num_blocks / 64) and wins when ids are dense in [0, num_blocks);
// Sort is O(n log n) and wins when num_blocks dwarfs n. Auto picks per side; the
// explicit choices exist so tests can check both give the same plan.
enum class IdSetMethod { Auto, Bitmap, Sort };

// Validates the request and builds the plan. Checks, first failure wins:
// length mismatch; num_regions, local_num_blocks, remote_num_blocks >= 1;
// num_regions * local_num_blocks, then * remote_num_blocks, <= INT32_MAX;
// local ids in range; remote ids in range; no duplicate local id; no duplicate remote id.
// A duplicate is reported at the first position, in array order, whose id occurred before.
// On failure `out` is unspecified.
Status plan_transfer(const PlanRequest& request, TransferPlan* out,
                     IdSetMethod method = IdSetMethod::Auto);

// Validates one side's block ids on their own, as a request names them before its pairing
// is known: num_blocks >= 1, each id in [0, num_blocks), no id repeated (messages as
// plan_transfer's, under `name`). Copies the ids into `out` (ids.size entries), reading
// each once, as copy_block_ids does. On failure `out` is unspecified.
Status check_block_ids(const BlockIdView& ids, const char* name, int64_t num_blocks,
                       int64_t* out, IdSetMethod method = IdSetMethod::Auto);

// ---------------------------------------------------------------------------------------
// Split blocks: the two sides hold the same tokens, but a block on the "coarse" side holds
// `split` (k) times the tokens of one on the "fine" side. Fine block i of a request is then
// slot i % k of coarse block coarse_ids[i / k]. Every block is head-major (each of `heads`
// heads holds its tokens contiguously), so a slot is not one byte range but `heads` of
// them, one per head: the descriptor lists are prepared at that granularity, and the
// descriptor of (region r, block b, slot s, head h) on a side is
// ((r * side_num_blocks + b) * side_split + s) * heads + h, with side_split 1 when fine.

struct SplitPlanRequest {
    BlockIdView local_ids;
    BlockIdView remote_ids;
    int64_t local_num_blocks = 0;
    int64_t remote_num_blocks = 0;
    int64_t num_regions = 0;
    int64_t heads = 0;
    // At most one of the two exceeds 1; that side is the coarse one. Both 1 is plain
    // per-head planning, and then remote counts as the coarse side (for the length rule).
    int64_t local_split = 0;
    int64_t remote_split = 0;
};

// A validated split request, compact like TransferPlan: O(n), the n * heads * num_regions
// descriptor indices are written on demand by write_indices.
struct SplitTransferPlan {
    // Pair i (in the given order: slots must stay with their coarse block, so nothing is
    // sorted) moves local unit local_units[i] to remote unit remote_units[i], for every
    // head in every region. A unit is block * side_split + slot, the descriptor index
    // of its head 0 in region 0 divided by heads.
    std::vector<int32_t> local_units;
    std::vector<int32_t> remote_units;
    // Maximal stretches of region 0's emitted (local, remote) descriptor index pairs that
    // advance by one on both sides: starts are region-0 descriptor indices, lengths count
    // descriptors. Every region has the same stretches, shifted.
    std::vector<Run> runs;
    int64_t local_units_per_region = 0;   // local_num_blocks * local_split
    int64_t remote_units_per_region = 0;  // remote_num_blocks * remote_split
    int64_t num_regions = 0;
    int64_t heads = 0;

    // True when the coarse side holds several slots and several heads per block: a slot's
    // heads then lie a head's worth of slots apart, so no two index-adjacent descriptors
    // are adjacent bytes there and NIXL merges nothing, whatever the runs say.
    bool heads_apart = false;

    int64_t num_blocks() const { return static_cast<int64_t>(local_units.size()); }
    int64_t num_runs() const { return static_cast<int64_t>(runs.size()); }
    // As TransferPlan::num_descriptors; never merged where heads_apart.
    int64_t num_descriptors(bool merges) const {
        return merges && !heads_apart ? num_runs() * num_regions
                                      : static_cast<int64_t>(num_indices());
    }
    // Length of each descriptor index list: n * heads * num_regions (<= INT32_MAX once
    // validated: the fine side's n distinct ids fit its index space).
    std::size_t num_indices() const {
        return local_units.size() * static_cast<std::size_t>(heads) *
               static_cast<std::size_t>(num_regions);
    }
    // Writes the two lists: entry (r * n + i) * heads + h is
    // (r * side_units_per_region + side_units[i]) * heads + h. Each buffer must hold
    // num_indices() entries.
    void write_indices(int32_t* local_out, int32_t* remote_out) const;
};

// Validates the split request and builds the plan. Checks, first failure wins:
// num_regions, local_num_blocks, remote_num_blocks, heads, local_split, remote_split >= 1;
// not both splits > 1; the coarse side has exactly ceil(n / k) ids, n the fine side's
// count; num_regions * local_num_blocks * local_split * heads, then the remote one,
// <= INT32_MAX; local ids in range; remote ids in range; no duplicate local id; no
// duplicate remote id (reported as plan_transfer reports them). On failure `out` is
// unspecified.
Status plan_split_transfer(const SplitPlanRequest& request, SplitTransferPlan* out,
                           IdSetMethod method = IdSetMethod::Auto);

// ---------------------------------------------------------------------------------------
// A link: the constants of every request between this side's cache and one peer's, fixed
// when the two sides shake hands. Planning a request over a link then takes only the ids.

struct LinkShape {
    int64_t local_num_blocks = 0;
    int64_t remote_num_blocks = 0;
    int64_t num_regions = 0;
    // 0: one descriptor per (region, block), plan_transfer. Above 0: per (region, block,
    // slot, head) descriptors, plan_split_transfer with these heads and splits.
    int64_t heads = 0;
    int64_t local_split = 1;
    int64_t remote_split = 1;
    // Adjacent descriptor indices are adjacent bytes on both sides (see num_descriptors).
    bool merges = true;

    bool split() const { return heads > 0; }
};

// Checks a link's constants once, as the plan functions would on every request: counts
// >= 1 (heads >= 0), not both splits above 1, splits 1 without heads, and each side's
// index space within int32. Messages are the plan functions' own.
Status check_link(const LinkShape& shape);

}  // namespace kvpush
