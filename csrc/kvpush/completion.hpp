// Completion table: counts the parts of a transfer (e.g. one per layer per rank) as their
// notifications arrive, and says exactly once when the last one is in.
//
// Notifications come from whichever thread polls NIXL, possibly several, and may repeat
// or arrive for requests already removed; so every operation takes the lock, and arrive()
// reports such cases as values instead of failing.
#pragma once

#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "kvpush/status.hpp"

namespace kvpush {

enum class Arrival : int {
    Pending = 0,     // counted; more parts outstanding
    Complete = 1,    // counted, and it was the last one: returned once per key
    Duplicate = 2,   // this part had already arrived; nothing changed
    Unknown = 3,     // no such key (never expected, or already removed)
    OutOfRange = 4,  // part outside [0, parts)
};

struct Progress {
    int64_t arrived;
    int64_t expected;
};

class CompletionTable {
public:
    // Bounds the per-key bitset (2 MiB) so a bad count cannot exhaust memory.
    static constexpr int64_t kMaxParts = int64_t{1} << 24;

    // InvalidArgument unless 1 <= parts <= kMaxParts; AlreadyExists if the key is held.
    Status expect(const std::string& key, int64_t parts);
    Arrival arrive(const std::string& key, int64_t part);
    // Whether the key was held.
    bool remove(const std::string& key);
    std::optional<Progress> progress(const std::string& key) const;
    std::size_t size() const;
    bool contains(const std::string& key) const;

private:
    struct Entry {
        int64_t expected;
        int64_t arrived;
        std::vector<uint64_t> seen;  // one bit per part
    };

    mutable std::mutex mu_;
    std::unordered_map<std::string, Entry> entries_;
};

}  // namespace kvpush
