// Error reporting for the Python-free core.
//
// The core never throws for bad input: every entry point returns a Status, and the
// bindings turn a non-ok one into a Python exception. That keeps the core usable from
// plain C++ (and its unit test) and keeps exception policy in one place, at the edge.
#pragma once

#include <string>
#include <utility>

namespace kvpush {

enum class StatusCode {
    Ok,
    InvalidArgument,  // malformed scalar or array argument
    OutOfRange,       // a block id outside [0, num_blocks)
    Duplicate,        // the same block id twice on one side
    LengthMismatch,   // local and remote id arrays of different length
    AlreadyExists,    // a key that is already registered
    NotFound,         // a key that is not registered
};

struct Status {
    StatusCode code = StatusCode::Ok;
    std::string message;

    bool ok() const { return code == StatusCode::Ok; }

    static Status Ok() { return {}; }
    static Status InvalidArgument(std::string msg) {
        return {StatusCode::InvalidArgument, std::move(msg)};
    }
    static Status OutOfRange(std::string msg) {
        return {StatusCode::OutOfRange, std::move(msg)};
    }
    static Status Duplicate(std::string msg) {
        return {StatusCode::Duplicate, std::move(msg)};
    }
    static Status LengthMismatch(std::string msg) {
        return {StatusCode::LengthMismatch, std::move(msg)};
    }
    static Status AlreadyExists(std::string msg) {
        return {StatusCode::AlreadyExists, std::move(msg)};
    }
    static Status NotFound(std::string msg) {
        return {StatusCode::NotFound, std::move(msg)};
    }
};

}  // namespace kvpush
