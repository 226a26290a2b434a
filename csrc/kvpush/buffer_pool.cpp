#include "kvpush/buffer_pool.hpp"

#include <cstdint>
#include <cstdlib>
#include <new>

namespace kvpush {

BufferPool::~BufferPool() {
    for (const Entry& e : free_) std::free(e.buffer);
}

int32_t* BufferPool::acquire(std::size_t count, std::size_t* capacity) {
    {
        const std::lock_guard<std::mutex> lock(mutex_);
        // Most recently released first: the likeliest to be in cache.
        for (std::size_t i = free_.size(); i-- > 0;) {
            const Entry e = free_[i];
            if (e.capacity >= count && e.capacity / 2 <= count) {
                free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(i));
                free_bytes_ -= e.capacity * sizeof(int32_t);
                *capacity = e.capacity;
                return e.buffer;
            }
        }
    }
    const std::size_t entries = count > 0 ? count : 1;
    if (entries > SIZE_MAX / sizeof(int32_t)) throw std::bad_alloc();
    auto* buffer = static_cast<int32_t*>(std::malloc(entries * sizeof(int32_t)));
    if (buffer == nullptr) throw std::bad_alloc();
    *capacity = entries;
    return buffer;
}

void BufferPool::release(int32_t* buffer, std::size_t capacity) {
    if (buffer == nullptr) return;
    const std::size_t bytes = capacity * sizeof(int32_t);
    std::vector<int32_t*> dropped;  // freed outside the lock
    {
        const std::lock_guard<std::mutex> lock(mutex_);
        if (max_buffers_ > 0 && bytes <= max_bytes_) {
            // Make room by dropping the oldest buffers.
            while (!free_.empty() &&
                   (free_.size() >= max_buffers_ || free_bytes_ + bytes > max_bytes_)) {
                dropped.push_back(free_.front().buffer);
                free_bytes_ -= free_.front().capacity * sizeof(int32_t);
                free_.erase(free_.begin());
            }
            free_.push_back(Entry{buffer, capacity});
            free_bytes_ += bytes;
            buffer = nullptr;
        }
    }
    for (int32_t* p : dropped) std::free(p);
    std::free(buffer);  // null when cached
}

std::size_t BufferPool::cached() const {
    const std::lock_guard<std::mutex> lock(mutex_);
    return free_.size();
}

}  // namespace kvpush
