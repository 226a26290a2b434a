#include "kvpush/completion.hpp"

#include <string>
#include <utility>

namespace kvpush {

Status CompletionTable::expect(const std::string& key, int64_t parts) {
    if (parts < 1 || parts > kMaxParts) {
        return Status::InvalidArgument("parts must be in [1, " + std::to_string(kMaxParts) +
                                       "], got " + std::to_string(parts));
    }
    // Allocate before locking: the bitset can be megabytes, and other threads keep arriving.
    Entry entry{parts, 0, std::vector<uint64_t>(static_cast<std::size_t>((parts + 63) / 64), 0)};
    std::lock_guard<std::mutex> lock(mu_);
    if (!entries_.emplace(key, std::move(entry)).second) {
        return Status::AlreadyExists("completion key '" + key + "' is already expected");
    }
    return Status::Ok();
}

Arrival CompletionTable::arrive(const std::string& key, int64_t part) {
    std::lock_guard<std::mutex> lock(mu_);
    const auto it = entries_.find(key);
    if (it == entries_.end()) return Arrival::Unknown;
    Entry& entry = it->second;
    if (part < 0 || part >= entry.expected) return Arrival::OutOfRange;
    uint64_t& word = entry.seen[static_cast<std::size_t>(part / 64)];
    const uint64_t bit = uint64_t{1} << (part % 64);
    if ((word & bit) != 0) return Arrival::Duplicate;
    word |= bit;
    ++entry.arrived;
    return entry.arrived == entry.expected ? Arrival::Complete : Arrival::Pending;
}

bool CompletionTable::remove(const std::string& key) {
    std::lock_guard<std::mutex> lock(mu_);
    return entries_.erase(key) != 0;
}

std::optional<Progress> CompletionTable::progress(const std::string& key) const {
    std::lock_guard<std::mutex> lock(mu_);
    const auto it = entries_.find(key);
    if (it == entries_.end()) return std::nullopt;
    return Progress{it->second.arrived, it->second.expected};
}

std::size_t CompletionTable::size() const {
    std::lock_guard<std::mutex> lock(mu_);
    return entries_.size();
}

bool CompletionTable::contains(const std::string& key) const {
    std::lock_guard<std::mutex> lock(mu_);
    return entries_.count(key) != 0;
}

}  // namespace kvpush
