// Per-block checksums, to check that a transfer delivered the bytes it should have.
//
// The hash (non-cryptographic; it catches corruption and misplaced blocks, not attacks):
// a block's bytes in every region, regions in the given order, each region's bytes read
// as little-endian 64-bit words with the last one zero-padded. Word k of a region (k
// restarting at 0 per region) feeds lane k % 4 of four running states, which start at
// kSeed + j * kMul2 (j = 0..3) and carry over from region to region:
//
//     round(v, w) = rotl64(v + w * kMul2, 31) * kMul1
//
// Then h = (num_regions * block_bytes) * kMul1; h = round(h, v[j]) for j = 0..3; and
// h ^= h >> 32; h *= kMul2; h ^= h >> 29; h *= kMul1; h ^= h >> 32. All arithmetic is
// modulo 2^64. Four lanes let the CPU overlap the multiplies (one lane is bound by
// multiply latency); restarting k per region keeps the lanes numpy-computable, which
// tests/support/reference.py relies on. Any change here must be made there too.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kvpush/plan.hpp"
#include "kvpush/status.hpp"

namespace kvpush {

inline constexpr uint64_t kChecksumSeed = 0x243F6A8885A308D3ull;  // pi's fraction
inline constexpr uint64_t kChecksumMul1 = 0x9E3779B97F4A7C15ull;  // golden ratio
inline constexpr uint64_t kChecksumMul2 = 0xD1B54A32D192ED03ull;

struct ChecksumRequest {
    // Block b of region r spans [base_addresses[r] + b * block_stride, + block_bytes).
    const uint64_t* base_addresses = nullptr;
    std::size_t num_regions = 0;
    int64_t block_stride = 0;
    int64_t block_bytes = 0;
    BlockIdView block_ids;
    int64_t num_blocks = 0;
};

// Writes one checksum per id, in the given order, to out[0 .. block_ids.size). Checks,
// first failure wins: at least one region; block_bytes >= 1; block_stride >= block_bytes;
// num_blocks >= 1; num_blocks * block_stride fits in int64; every id in [0, num_blocks).
// The memory itself is the caller's responsibility: it is read, never checked.
Status block_checksums(const ChecksumRequest& request, uint64_t* out);

}  // namespace kvpush
