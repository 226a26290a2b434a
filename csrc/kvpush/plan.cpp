#include "kvpush/plan.hpp"

#include <algorithm>
#include <cassert>
#include <cstdint>
#include <limits>
#include <string>

namespace kvpush {
namespace {

constexpr std::size_t kNoRepeat = std::numeric_limits<std::size_t>::max();

// Bitmap or sort, by how sparse the ids are. Timed on random ids (n = 8 .. 8192, coalesce
// on) with the bitmap's ordering through a num_blocks-entry partner table: the bitmap
// (clear + scan num_blocks / 64 words) beat std::sort until num_blocks was roughly 256 to
// 1024 times n, the ratio growing with n. Ordering by rank (per-word counts instead of
// the table) only made the bitmap cheaper, so the limit stays on the safe side. The slack
// keeps small requests on small caches on the bitmap, where either way costs well under a
// microsecond.
constexpr int64_t kBitmapBlocksPerId = 256;
constexpr int64_t kBitmapSlack = 1 << 14;

template <class T>
Status copy_ids(const T* ids, std::size_t n, const char* name, int64_t num_blocks,
                int64_t* out) {
    // Copy and check in one branch-free pass (vectorizes); locate the culprit only on failure.
    bool any_bad = false;
    for (std::size_t i = 0; i < n; ++i) {
        const int64_t b = ids[i];
        out[i] = b;
        any_bad |= static_cast<uint64_t>(b) >= static_cast<uint64_t>(num_blocks);
    }
    if (!any_bad) return Status::Ok();
    for (std::size_t i = 0; i < n; ++i) {
        if (out[i] < 0 || out[i] >= num_blocks) {
            return Status::OutOfRange(std::string(name) + "[" + std::to_string(i) +
                                      "] = " + std::to_string(out[i]) + " is out of range [0, " +
                                      std::to_string(num_blocks) + ")");
        }
    }
    return Status::Ok();  // unreachable: any_bad implies a culprit in the copy
}

Status require_positive(const char* name, int64_t value) {
    if (value >= 1) return Status::Ok();
    return Status::InvalidArgument(std::string(name) + " must be >= 1, got " +
                                   std::to_string(value));
}

// Descriptor indices go to NIXL as int32, so the whole region-major index space must fit.
// Both factors are >= 1 here; dividing instead of multiplying cannot overflow.
Status require_index_fit(int64_t num_regions, const char* blocks_name, int64_t num_blocks) {
    if (num_blocks <= std::numeric_limits<int32_t>::max() / num_regions) return Status::Ok();
    return Status::InvalidArgument(std::string("num_regions * ") + blocks_name + " = " +
                                   std::to_string(num_regions) + " * " +
                                   std::to_string(num_blocks) +
                                   " does not fit in int32 descriptor indices");
}

class BlockBitmap {
public:
    explicit BlockBitmap(int64_t num_blocks)
        : words_(static_cast<std::size_t>((num_blocks + 63) / 64), 0) {}

    // Returns whether `b` was already set.
    bool test_and_set(int64_t b) {
        uint64_t& word = words_[static_cast<std::size_t>(b >> 6)];
        const uint64_t bit = uint64_t{1} << (b & 63);
        const bool was_set = (word & bit) != 0;
        word |= bit;
        return was_set;
    }

    // Makes rank() valid: counts the set bits before each word. Call once all bits are set.
    void count_ranks() {
        below_.resize(words_.size());
        uint32_t total = 0;  // at most num_blocks <= INT32_MAX bits are set
        for (std::size_t w = 0; w < words_.size(); ++w) {
            below_[w] = total;
            total += popcount64(words_[w]);
        }
    }

    // How many set bits lie below `b`: b's place among the set ids in increasing order.
    std::size_t rank(int64_t b) const {
        const auto w = static_cast<std::size_t>(b >> 6);
        const uint64_t lower = words_[w] & ((uint64_t{1} << (b & 63)) - 1);
        return below_[w] + popcount64(lower);
    }

private:
    // Baseline x86-64 has no POPCNT instruction and __builtin_popcountll becomes a libgcc
    // call there, several times slower than these few shifts and adds.
    static uint32_t popcount64(uint64_t x) {
        x = x - ((x >> 1) & 0x5555555555555555ULL);
        x = (x & 0x3333333333333333ULL) + ((x >> 2) & 0x3333333333333333ULL);
        x = (x + (x >> 4)) & 0x0f0f0f0f0f0f0f0fULL;
        return static_cast<uint32_t>((x * 0x0101010101010101ULL) >> 56);
    }

    std::vector<uint64_t> words_;
    std::vector<uint32_t> below_;
};

std::size_t first_repeat_bitmap(const int64_t* ids, std::size_t n, BlockBitmap* seen) {
    for (std::size_t i = 0; i < n; ++i) {
        if (seen->test_and_set(ids[i])) return i;
    }
    return kNoRepeat;
}

// Sorts (id << 32 | position) keys: equal ids end up adjacent with positions ascending,
// so the second key of each equal group is that group's first repeat.
std::size_t first_repeat_sort(const int64_t* ids, std::size_t n, std::vector<uint64_t>* keys) {
    keys->resize(n);
    for (std::size_t i = 0; i < n; ++i) {
        (*keys)[i] = (static_cast<uint64_t>(ids[i]) << 32) | static_cast<uint64_t>(i);
    }
    std::sort(keys->begin(), keys->end());
    std::size_t first = kNoRepeat;
    for (std::size_t k = 1; k < keys->size(); ++k) {
        if (((*keys)[k] >> 32) == ((*keys)[k - 1] >> 32)) {
            first = std::min(first, static_cast<std::size_t>((*keys)[k] & 0xffffffffu));
        }
    }
    return first;
}

Status duplicate_error(const char* name, const int64_t* ids, std::size_t repeat) {
    // The first repeat has exactly one earlier occurrence: a second would repeat sooner.
    const std::size_t earlier =
        static_cast<std::size_t>(std::find(ids, ids + repeat, ids[repeat]) - ids);
    return Status::Duplicate(std::string(name) + " has duplicate block id " +
                             std::to_string(ids[repeat]) + " (positions " +
                             std::to_string(earlier) + " and " + std::to_string(repeat) + ")");
}

IdSetMethod resolve(IdSetMethod method, std::size_t n, int64_t num_blocks) {
    // Sort keys hold positions in 32 bits. More ids than that, all below INT32_MAX, must
    // repeat anyway, and the bitmap finds the repeat without the limit.
    if (n > 0xffffffffu) return IdSetMethod::Bitmap;
    if (method != IdSetMethod::Auto) return method;
    const bool dense = num_blocks <= kBitmapBlocksPerId * static_cast<int64_t>(n) + kBitmapSlack;
    return dense ? IdSetMethod::Bitmap : IdSetMethod::Sort;
}

}  // namespace

Status copy_block_ids(const BlockIdView& ids, const char* name, int64_t num_blocks,
                      std::vector<int64_t>* out) {
    out->resize(ids.size);
    if (ids.is_int64) {
        return copy_ids(static_cast<const int64_t*>(ids.data), ids.size, name, num_blocks,
                        out->data());
    }
    return copy_ids(static_cast<const int32_t*>(ids.data), ids.size, name, num_blocks,
                    out->data());
}

Status plan_transfer(const PlanRequest& req, TransferPlan* out, IdSetMethod method) {
    const std::size_t n = req.local_ids.size;
    if (req.remote_ids.size != n) {
        return Status::LengthMismatch("local_ids and remote_ids differ in length: " +
                                      std::to_string(n) + " != " +
                                      std::to_string(req.remote_ids.size));
    }
    Status s = require_positive("num_regions", req.num_regions);
    if (s.ok()) s = require_positive("local_num_blocks", req.local_num_blocks);
    if (s.ok()) s = require_positive("remote_num_blocks", req.remote_num_blocks);
    if (s.ok()) s = require_index_fit(req.num_regions, "local_num_blocks", req.local_num_blocks);
    if (s.ok()) s = require_index_fit(req.num_regions, "remote_num_blocks", req.remote_num_blocks);
    if (!s.ok()) return s;

    std::vector<int64_t> local;
    std::vector<int64_t> remote;
    s = copy_block_ids(req.local_ids, "local_ids", req.local_num_blocks, &local);
    if (s.ok()) s = copy_block_ids(req.remote_ids, "remote_ids", req.remote_num_blocks, &remote);
    if (!s.ok()) return s;

    // Local side first: its bitmap or sorted keys are reused to order the pairs.
    const IdSetMethod local_method = resolve(method, n, req.local_num_blocks);
    BlockBitmap local_seen(local_method == IdSetMethod::Bitmap ? req.local_num_blocks : 0);
    std::vector<uint64_t> local_keys;
    std::size_t repeat = local_method == IdSetMethod::Bitmap
                             ? first_repeat_bitmap(local.data(), n, &local_seen)
                             : first_repeat_sort(local.data(), n, &local_keys);
    if (repeat != kNoRepeat) return duplicate_error("local_ids", local.data(), repeat);

    if (resolve(method, n, req.remote_num_blocks) == IdSetMethod::Bitmap) {
        BlockBitmap remote_seen(req.remote_num_blocks);
        repeat = first_repeat_bitmap(remote.data(), n, &remote_seen);
    } else {
        std::vector<uint64_t> remote_keys;
        repeat = first_repeat_sort(remote.data(), n, &remote_keys);
    }
    if (repeat != kNoRepeat) return duplicate_error("remote_ids", remote.data(), repeat);

    // Every id now lies in [0, num_blocks) <= [0, INT32_MAX], so int32 holds it.
    std::vector<int32_t>& pair_local = out->local_blocks;
    std::vector<int32_t>& pair_remote = out->remote_blocks;
    pair_local.resize(n);
    pair_remote.resize(n);
    if (!req.coalesce) {
        for (std::size_t i = 0; i < n; ++i) {
            pair_local[i] = static_cast<int32_t>(local[i]);
            pair_remote[i] = static_cast<int32_t>(remote[i]);
        }
    } else if (local_method == IdSetMethod::Bitmap) {
        // A counting sort: each local id's place in increasing order is its rank in the
        // bitmap (set bits below it), so every pair goes straight to its place. The bitmap
        // and its per-word counts take 1/32 and 1/64 byte per block (8 KiB for 32k blocks,
        // cache-resident), where a num_blocks-sized partner table missed the cache on
        // every access.
        local_seen.count_ranks();
        for (std::size_t i = 0; i < n; ++i) {
            const std::size_t k = local_seen.rank(local[i]);
            assert(k < n);  // ids are unique, so ranks are a permutation of [0, n)
            pair_local[k] = static_cast<int32_t>(local[i]);
            pair_remote[k] = static_cast<int32_t>(remote[i]);
        }
    } else {
        for (std::size_t k = 0; k < n; ++k) {
            const std::size_t pos = static_cast<std::size_t>(local_keys[k] & 0xffffffffu);
            pair_local[k] = static_cast<int32_t>(local_keys[k] >> 32);
            pair_remote[k] = static_cast<int32_t>(remote[pos]);
        }
    }

    // At most n runs; sized up front and trimmed, since growing it run by run showed up
    // as a third of the whole call in profiles.
    std::vector<Run>& runs = out->runs;
    runs.resize(n);
    std::size_t num_runs = 0;
    for (std::size_t k = 0; k < n; ++k) {
        const bool extends = k > 0 && pair_local[k] == pair_local[k - 1] + 1 &&
                             pair_remote[k] == pair_remote[k - 1] + 1;
        if (extends) {
            ++runs[num_runs - 1].length;
        } else {
            runs[num_runs].local_start = pair_local[k];
            runs[num_runs].remote_start = pair_remote[k];
            runs[num_runs].length = 1;
            ++num_runs;
        }
    }
    runs.resize(num_runs);

    out->local_num_blocks = req.local_num_blocks;
    out->remote_num_blocks = req.remote_num_blocks;
    out->num_regions = req.num_regions;
    return Status::Ok();
}

void TransferPlan::write_indices(int32_t* local_out, int32_t* remote_out) const {
    // Validation bounded num_regions * num_blocks by INT32_MAX, so int32 math cannot overflow.
    const std::size_t n = local_blocks.size();
    const int32_t* local_ids = local_blocks.data();
    const int32_t* remote_ids = remote_blocks.data();
    for (int64_t r = 0; r < num_regions; ++r) {
        const auto local_base = static_cast<int32_t>(r * local_num_blocks);
        const auto remote_base = static_cast<int32_t>(r * remote_num_blocks);
        int32_t* local_row = local_out + static_cast<std::size_t>(r) * n;
        int32_t* remote_row = remote_out + static_cast<std::size_t>(r) * n;
        for (std::size_t k = 0; k < n; ++k) local_row[k] = local_base + local_ids[k];
        for (std::size_t k = 0; k < n; ++k) remote_row[k] = remote_base + remote_ids[k];
    }
}

// ---------------------------------------------------------------------------------------
// plan_split_transfer

namespace {

// The split index space, num_regions * num_blocks * split * heads, must fit in int32 too.
// All four are >= 1 here; floor(floor(m / a) / b) == floor(m / (a * b)), so dividing the
// limit factor by factor is exact and, unlike multiplying, cannot overflow.
Status require_split_index_fit(int64_t num_regions, const char* blocks_name,
                               int64_t num_blocks, const char* split_name, int64_t split,
                               int64_t heads) {
    const int64_t room = std::numeric_limits<int32_t>::max() / num_regions / split / heads;
    if (num_blocks <= room) return Status::Ok();
    return Status::InvalidArgument(
        std::string("num_regions * ") + blocks_name + " * " + split_name + " * heads = " +
        std::to_string(num_regions) + " * " + std::to_string(num_blocks) + " * " +
        std::to_string(split) + " * " + std::to_string(heads) +
        " does not fit in int32 descriptor indices");
}

std::size_t first_repeat(const int64_t* ids, std::size_t n, IdSetMethod method,
                         int64_t num_blocks) {
    if (resolve(method, n, num_blocks) == IdSetMethod::Bitmap) {
        BlockBitmap seen(num_blocks);
        return first_repeat_bitmap(ids, n, &seen);
    }
    std::vector<uint64_t> keys;
    return first_repeat_sort(ids, n, &keys);
}

// Pair i's unit on one side: slot i % split of block ids[i / split]. Validation bounded
// num_blocks * split by INT32_MAX, so the unit fits in int32.
void fill_units(const std::vector<int64_t>& ids, int64_t split, std::size_t n,
                std::vector<int32_t>* units) {
    units->resize(n);
    const auto s = static_cast<std::size_t>(split);
    for (std::size_t i = 0; i < n; ++i) {
        (*units)[i] = static_cast<int32_t>(ids[i / s] * split + static_cast<int64_t>(i % s));
    }
}

// Region 0's row first; every other region's is that row plus a constant, a plain loop
// the compiler vectorizes, instead of recomputing unit * heads + h per entry.
void write_split_side(const std::vector<int32_t>& units, int64_t units_per_region,
                      int64_t heads, int64_t num_regions, int32_t* out) {
    // Validation bounded num_regions * units_per_region * heads by INT32_MAX.
    const auto h = static_cast<int32_t>(heads);
    const std::size_t row = units.size() * static_cast<std::size_t>(heads);
    int32_t* at = out;
    for (const int32_t unit : units) {
        const int32_t base = unit * h;
        for (int32_t j = 0; j < h; ++j) *at++ = base + j;
    }
    for (int64_t r = 1; r < num_regions; ++r) {
        const auto shift = static_cast<int32_t>(r * units_per_region * heads);
        int32_t* dst = out + static_cast<std::size_t>(r) * row;
        for (std::size_t k = 0; k < row; ++k) dst[k] = out[k] + shift;
    }
}

}  // namespace

Status plan_split_transfer(const SplitPlanRequest& req, SplitTransferPlan* out,
                           IdSetMethod method) {
    // The length rule depends on the splits, so unlike plan_transfer the scalars come first.
    Status s = require_positive("num_regions", req.num_regions);
    if (s.ok()) s = require_positive("local_num_blocks", req.local_num_blocks);
    if (s.ok()) s = require_positive("remote_num_blocks", req.remote_num_blocks);
    if (s.ok()) s = require_positive("heads", req.heads);
    if (s.ok()) s = require_positive("local_split", req.local_split);
    if (s.ok()) s = require_positive("remote_split", req.remote_split);
    if (!s.ok()) return s;
    if (req.local_split > 1 && req.remote_split > 1) {
        return Status::InvalidArgument("local_split and remote_split cannot both exceed 1, got " +
                                       std::to_string(req.local_split) + " and " +
                                       std::to_string(req.remote_split));
    }

    const bool local_coarse = req.local_split > 1;
    const BlockIdView& fine = local_coarse ? req.remote_ids : req.local_ids;
    const BlockIdView& coarse = local_coarse ? req.local_ids : req.remote_ids;
    const int64_t k = local_coarse ? req.local_split : req.remote_split;
    const std::size_t n = fine.size;
    const auto uk = static_cast<uint64_t>(k);
    const auto expected = static_cast<std::size_t>(n / uk + (n % uk != 0 ? 1 : 0));
    if (coarse.size != expected) {
        const std::string coarse_side = local_coarse ? "local" : "remote";
        const std::string fine_side = local_coarse ? "remote" : "local";
        return Status::LengthMismatch(
            coarse_side + "_ids has " + std::to_string(coarse.size) + " entries, but " +
            std::to_string(n) + " " + fine_side + "_ids at " + coarse_side + "_split = " +
            std::to_string(k) + " need ceil(" + std::to_string(n) + " / " + std::to_string(k) +
            ") = " + std::to_string(expected));
    }

    s = require_split_index_fit(req.num_regions, "local_num_blocks", req.local_num_blocks,
                                "local_split", req.local_split, req.heads);
    if (s.ok()) {
        s = require_split_index_fit(req.num_regions, "remote_num_blocks", req.remote_num_blocks,
                                    "remote_split", req.remote_split, req.heads);
    }
    if (!s.ok()) return s;

    std::vector<int64_t> local;
    std::vector<int64_t> remote;
    s = copy_block_ids(req.local_ids, "local_ids", req.local_num_blocks, &local);
    if (s.ok()) s = copy_block_ids(req.remote_ids, "remote_ids", req.remote_num_blocks, &remote);
    if (!s.ok()) return s;
    std::size_t repeat = first_repeat(local.data(), local.size(), method, req.local_num_blocks);
    if (repeat != kNoRepeat) return duplicate_error("local_ids", local.data(), repeat);
    repeat = first_repeat(remote.data(), remote.size(), method, req.remote_num_blocks);
    if (repeat != kNoRepeat) return duplicate_error("remote_ids", remote.data(), repeat);

    fill_units(local, req.local_split, n, &out->local_units);
    fill_units(remote, req.remote_split, n, &out->remote_units);

    // Within a pair the heads always advance together on both sides, so region 0's index
    // pairs break only between pairs, and exactly where a unit fails to advance by one:
    // runs over units, scaled by heads, are the runs over descriptor indices.
    const std::vector<int32_t>& lu = out->local_units;
    const std::vector<int32_t>& ru = out->remote_units;
    std::vector<Run>& runs = out->runs;
    runs.resize(n);  // at most n; sized up front and trimmed, as in plan_transfer
    std::size_t num_runs = 0;
    for (std::size_t i = 0; i < n; ++i) {
        if (i > 0 && lu[i] == lu[i - 1] + 1 && ru[i] == ru[i - 1] + 1) {
            ++runs[num_runs - 1].length;
        } else {
            runs[num_runs] = Run{lu[i], ru[i], 1};
            ++num_runs;
        }
    }
    runs.resize(num_runs);
    for (Run& run : runs) {
        run.local_start *= req.heads;
        run.remote_start *= req.heads;
        run.length *= req.heads;
    }

    out->local_units_per_region = req.local_num_blocks * req.local_split;
    out->remote_units_per_region = req.remote_num_blocks * req.remote_split;
    out->num_regions = req.num_regions;
    out->heads = req.heads;
    out->heads_apart = k > 1 && req.heads > 1;
    return Status::Ok();
}

void SplitTransferPlan::write_indices(int32_t* local_out, int32_t* remote_out) const {
    write_split_side(local_units, local_units_per_region, heads, num_regions, local_out);
    write_split_side(remote_units, remote_units_per_region, heads, num_regions, remote_out);
}

// ---------------------------------------------------------------------------------------
// check_block_ids

Status check_block_ids(const BlockIdView& ids, const char* name, int64_t num_blocks,
                       int64_t* out, IdSetMethod method) {
    Status s = require_positive("num_blocks", num_blocks);
    if (!s.ok()) return s;
    s = ids.is_int64 ? copy_ids(static_cast<const int64_t*>(ids.data), ids.size, name,
                                num_blocks, out)
                     : copy_ids(static_cast<const int32_t*>(ids.data), ids.size, name,
                                num_blocks, out);
    if (!s.ok()) return s;
    const std::size_t repeat = first_repeat(out, ids.size, method, num_blocks);
    if (repeat != kNoRepeat) return duplicate_error(name, out, repeat);
    return Status::Ok();
}

// ---------------------------------------------------------------------------------------
// check_link

Status check_link(const LinkShape& shape) {
    Status s = require_positive("num_regions", shape.num_regions);
    if (s.ok()) s = require_positive("local_num_blocks", shape.local_num_blocks);
    if (s.ok()) s = require_positive("remote_num_blocks", shape.remote_num_blocks);
    if (!s.ok()) return s;
    if (!shape.split()) {
        if (shape.heads < 0) {
            return Status::InvalidArgument("heads must be >= 0, got " +
                                           std::to_string(shape.heads));
        }
        if (shape.local_split != 1 || shape.remote_split != 1) {
            return Status::InvalidArgument("a link without heads has splits 1, got " +
                                           std::to_string(shape.local_split) + " and " +
                                           std::to_string(shape.remote_split));
        }
        s = require_index_fit(shape.num_regions, "local_num_blocks", shape.local_num_blocks);
        if (s.ok()) {
            s = require_index_fit(shape.num_regions, "remote_num_blocks",
                                  shape.remote_num_blocks);
        }
        return s;
    }
    s = require_positive("local_split", shape.local_split);
    if (s.ok()) s = require_positive("remote_split", shape.remote_split);
    if (!s.ok()) return s;
    if (shape.local_split > 1 && shape.remote_split > 1) {
        return Status::InvalidArgument("local_split and remote_split cannot both exceed 1, got " +
                                       std::to_string(shape.local_split) + " and " +
                                       std::to_string(shape.remote_split));
    }
    s = require_split_index_fit(shape.num_regions, "local_num_blocks", shape.local_num_blocks,
                                "local_split", shape.local_split, shape.heads);
    if (s.ok()) {
        s = require_split_index_fit(shape.num_regions, "remote_num_blocks",
                                    shape.remote_num_blocks, "remote_split", shape.remote_split,
                                    shape.heads);
    }
    return s;
}

}  // namespace kvpush
