// A small cache of large index buffers, so that planning transfer after transfer does not
// hand the same few hundred KiB back and forth to the system allocator.
//
// Why: a plan's two index lists are 4 * n * num_regions bytes each (256 KiB each for 8k
// tokens of a 128-region cache). glibc serves blocks that size from the top of its heap
// and, when they are freed, often trims the heap top back to the system; the next plan
// then faults every page in again: a hundred page faults per 8k-token plan, several times
// the plan's own work.
// Buffers returned to this pool are handed out again, already mapped and usually cached.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <vector>

namespace kvpush {

class BufferPool {
public:
    // Keeps at most `max_buffers` free buffers and `max_bytes` of them in all.
    BufferPool(std::size_t max_buffers, std::size_t max_bytes)
        : max_buffers_(max_buffers), max_bytes_(max_bytes) {}
    ~BufferPool();
    BufferPool(const BufferPool&) = delete;
    BufferPool& operator=(const BufferPool&) = delete;

    // A buffer of at least `count` int32 entries, uninitialised; its capacity (entries)
    // goes to `*capacity`. A cached buffer is reused when it holds `count` entries and at
    // most twice that. Never returns null: allocation failure throws std::bad_alloc.
    // Thread-safe.
    int32_t* acquire(std::size_t count, std::size_t* capacity);

    // Gives back a buffer from acquire() with the capacity acquire() reported: cached if
    // there is room, freed otherwise. Thread-safe.
    void release(int32_t* buffer, std::size_t capacity);

    // Free buffers cached now (for tests).
    std::size_t cached() const;

private:
    struct Entry {
        int32_t* buffer;
        std::size_t capacity;
    };

    const std::size_t max_buffers_;
    const std::size_t max_bytes_;
    mutable std::mutex mutex_;
    std::vector<Entry> free_;  // most recently released last
    std::size_t free_bytes_ = 0;
};

}  // namespace kvpush
