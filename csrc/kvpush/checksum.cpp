#include "kvpush/checksum.hpp"

#include <cstring>
#include <limits>
#include <string>
#include <vector>

namespace kvpush {
namespace {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "the checksum reads words little-endian; a big-endian port must byte-swap");

inline uint64_t rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

inline uint64_t round_(uint64_t v, uint64_t w) {
    return rotl64(v + w * kChecksumMul2, 31) * kChecksumMul1;
}

// memcpy rather than a cast: blocks need not be 8-byte aligned, and it compiles to one load.
inline uint64_t load_word(const unsigned char* p) {
    uint64_t w;
    std::memcpy(&w, p, sizeof w);
    return w;
}

uint64_t checksum_block(const uint64_t* bases, std::size_t num_regions, uint64_t offset,
                        std::size_t block_bytes) {
    uint64_t v0 = kChecksumSeed;
    uint64_t v1 = kChecksumSeed + 1 * kChecksumMul2;
    uint64_t v2 = kChecksumSeed + 2 * kChecksumMul2;
    uint64_t v3 = kChecksumSeed + 3 * kChecksumMul2;
    const std::size_t full_words = block_bytes / 8;
    const std::size_t tail_bytes = block_bytes % 8;
    for (std::size_t r = 0; r < num_regions; ++r) {
        const auto* p = reinterpret_cast<const unsigned char*>(bases[r] + offset);
        std::size_t k = 0;
        for (; k + 4 <= full_words; k += 4) {
            v0 = round_(v0, load_word(p + 8 * k));
            v1 = round_(v1, load_word(p + 8 * k + 8));
            v2 = round_(v2, load_word(p + 8 * k + 16));
            v3 = round_(v3, load_word(p + 8 * k + 24));
        }
        // Leftover words, then the zero-padded tail, continue the lane sequence k % 4.
        uint64_t* lanes[4] = {&v0, &v1, &v2, &v3};
        for (; k < full_words; ++k) *lanes[k % 4] = round_(*lanes[k % 4], load_word(p + 8 * k));
        if (tail_bytes != 0) {
            uint64_t w = 0;
            std::memcpy(&w, p + 8 * k, tail_bytes);
            *lanes[k % 4] = round_(*lanes[k % 4], w);
        }
    }
    uint64_t h = static_cast<uint64_t>(num_regions) * static_cast<uint64_t>(block_bytes) *
                 kChecksumMul1;
    h = round_(h, v0);
    h = round_(h, v1);
    h = round_(h, v2);
    h = round_(h, v3);
    h ^= h >> 32;
    h *= kChecksumMul2;
    h ^= h >> 29;
    h *= kChecksumMul1;
    h ^= h >> 32;
    return h;
}

}  // namespace

Status block_checksums(const ChecksumRequest& req, uint64_t* out) {
    if (req.num_regions == 0) {
        return Status::InvalidArgument("base_addresses is empty: need at least one region");
    }
    if (req.block_bytes < 1) {
        return Status::InvalidArgument("block_bytes must be >= 1, got " +
                                       std::to_string(req.block_bytes));
    }
    if (req.block_stride < req.block_bytes) {
        return Status::InvalidArgument("block_stride must be >= block_bytes, got " +
                                       std::to_string(req.block_stride) + " < " +
                                       std::to_string(req.block_bytes));
    }
    if (req.num_blocks < 1) {
        return Status::InvalidArgument("num_blocks must be >= 1, got " +
                                       std::to_string(req.num_blocks));
    }
    // Both are >= 1 here; dividing instead of multiplying cannot overflow.
    if (req.block_stride > std::numeric_limits<int64_t>::max() / req.num_blocks) {
        return Status::InvalidArgument("num_blocks * block_stride = " +
                                       std::to_string(req.num_blocks) + " * " +
                                       std::to_string(req.block_stride) +
                                       " does not fit in int64 byte offsets");
    }
    std::vector<int64_t> ids;
    Status s = copy_block_ids(req.block_ids, "block_ids", req.num_blocks, &ids);
    if (!s.ok()) return s;
    for (std::size_t i = 0; i < ids.size(); ++i) {
        const uint64_t offset =
            static_cast<uint64_t>(ids[i]) * static_cast<uint64_t>(req.block_stride);
        out[i] = checksum_block(req.base_addresses, req.num_regions, offset,
                                static_cast<std::size_t>(req.block_bytes));
    }
    return Status::Ok();
}

}  // namespace kvpush
