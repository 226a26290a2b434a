// kvpush._core: the Python face of csrc/kvpush. Only argument conversion and error
// translation live here; every rule about what is valid lives in the core, which
// reports it as a Status. The typed interface is kvpush/_core.pyi; a pure-Python twin
// that must behave identically is tests/support/reference.py (test support).
#include <pybind11/native_enum.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>

#include "kvpush/buffer_pool.hpp"
#include "kvpush/checksum.hpp"
#include "kvpush/completion.hpp"
#include "kvpush/plan.hpp"
#include "kvpush/status.hpp"

namespace py = pybind11;

namespace {

// When to let other Python threads run during compiled work. Dropping the GIL is cheap;
// taking it back is not: inside an engine whose own threads run Python, a thread that gave
// the GIL up waits for CPython's switch interval (5 ms by default) to get it back, so a plan
// of microseconds that released the GIL beside one busy thread would take milliseconds. So
// only work far longer than a hand-off runs without the GIL: plans of at least 4M index
// entries (a few ns each: milliseconds; a 32k-token Qwen3-32B request is 4M) and checksums
// over at least 16 MiB (over a millisecond at memory bandwidth).
constexpr double kReleaseGilEntries = double{1 << 22};
constexpr double kReleaseGilChecksumBytes = double{16 << 20};

[[noreturn]] void raise_invalid_block_ids(const std::string& message) {
    // Imported when needed, not at module load: kvpush.errors is plain Python and the
    // package imports _core, so an eager import here would be circular.
    const py::object cls = py::module_::import("kvpush.errors").attr("InvalidBlockIds");
    py::set_error(cls, message.c_str());
    throw py::error_already_set();
}

// Bad data -> InvalidBlockIds; missing or clashing keys -> KeyError.
void throw_if_error(const kvpush::Status& status) {
    using kvpush::StatusCode;
    switch (status.code) {
        case StatusCode::Ok:
            return;
        case StatusCode::AlreadyExists:
        case StatusCode::NotFound:
            throw py::key_error(status.message);
        case StatusCode::InvalidArgument:
        case StatusCode::OutOfRange:
        case StatusCode::Duplicate:
        case StatusCode::LengthMismatch:
            break;
    }
    raise_invalid_block_ids(status.message);
}

// Python ints are unbounded and the core takes int64. Clamping keeps an absurd value
// absurd, so it fails the same check, with the same message, as in the reference (which
// clamps the same way) instead of failing pybind11's conversion with a TypeError.
int64_t to_int64(const py::handle& value) {
    const auto index = py::reinterpret_steal<py::object>(PyNumber_Index(value.ptr()));
    if (!index) throw py::error_already_set();
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
    if (overflow > 0) return std::numeric_limits<int64_t>::max();
    if (overflow < 0) return std::numeric_limits<int64_t>::min();
    if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
    return v;
}

std::string describe_non_1d(const py::handle& obj) {
    if (!py::isinstance<py::array>(obj)) return py::repr(py::type::handle_of(obj));
    const auto arr = py::reinterpret_borrow<py::array>(obj);
    return std::to_string(arr.ndim()) + "-D array of " + std::string(py::str(arr.dtype()));
}

py::handle plain_ndarray_type() {
    return reinterpret_cast<PyObject*>(py::detail::npy_api::get().PyArray_Type_);
}

// Only reached for ndarray subclasses; numpy.ma is imported by numpy itself.
bool is_masked_array(const py::handle& obj) {
    const py::object cls = py::module_::import("numpy.ma").attr("MaskedArray");
    return py::isinstance(obj, cls);
}

// A view at an odd byte offset (np.frombuffer(..., offset=1)) is C-contiguous but reading
// its elements as int32/int64 is undefined behaviour.
bool is_aligned(const py::array& arr) {
    return (py::detail::array_proxy(arr.ptr())->flags &
            py::detail::npy_api::NPY_ARRAY_ALIGNED_) != 0;
}

// Never converts: a float or 2-D array, a list, a masked or misaligned array is a caller
// bug that a silent cast would hide.
kvpush::BlockIdView block_ids_arg(const py::handle& obj, const char* name) {
    const std::string expected = std::string(name) + " must be a 1-D int32 or int64 array, got ";
    if (!py::isinstance<py::array>(obj) || py::reinterpret_borrow<py::array>(obj).ndim() != 1) {
        raise_invalid_block_ids(expected + describe_non_1d(obj));
    }
    const auto arr = py::reinterpret_borrow<py::array>(obj);
    const bool is_int32 = py::isinstance<py::array_t<int32_t>>(obj);
    if (!is_int32 && !py::isinstance<py::array_t<int64_t>>(obj)) {
        raise_invalid_block_ids(expected + std::string(py::str(arr.dtype())));
    }
    if (!py::type::handle_of(obj).is(plain_ndarray_type()) && is_masked_array(obj)) {
        raise_invalid_block_ids(std::string(name) +
                                " must be a plain array, not a masked array (its mask would "
                                "be ignored)");
    }
    if ((arr.flags() & py::array::c_style) == 0) {
        raise_invalid_block_ids(std::string(name) + " must be C-contiguous");
    }
    if (!is_aligned(arr)) {
        raise_invalid_block_ids(std::string(name) + " must be aligned to its dtype's size");
    }
    const auto n = static_cast<std::size_t>(arr.shape(0));
    if (is_int32) return kvpush::BlockIdView::of(static_cast<const int32_t*>(arr.data()), n);
    return kvpush::BlockIdView::of(static_cast<const int64_t*>(arr.data()), n);
}

// A plan is shared between threads and must not change under them. Clears the flag the
// way numpy's PyArray_CLEARFLAGS and pybind11's Eigen casters do; going through
// arr.flags.writeable from C++ is a Python attribute call per array, a large share of a
// small plan.
template <class T>
py::array_t<T> read_only(py::array_t<T> arr) {
    py::detail::array_proxy(arr.ptr())->flags &= ~py::detail::npy_api::NPY_ARRAY_WRITEABLE_;
    return arr;
}

// Index lists of at least this many entries (16 KiB) come from a pool of reused buffers
// (see kvpush/buffer_pool.hpp); smaller ones are plain numpy arrays.
constexpr std::size_t kPooledEntries = 4096;

kvpush::BufferPool& index_pool() {
    // Never destroyed: arrays holding pool buffers may be freed during interpreter teardown.
    static auto* pool = new kvpush::BufferPool(16, std::size_t{128} << 20);
    return *pool;
}

// One pool buffer, given back unless a numpy array takes it over.
class PooledBuffer {
public:
    explicit PooledBuffer(std::size_t count) { data_ = index_pool().acquire(count, &capacity_); }
    ~PooledBuffer() { index_pool().release(data_, capacity_); }
    PooledBuffer(const PooledBuffer&) = delete;
    PooledBuffer& operator=(const PooledBuffer&) = delete;

    int32_t* data() const { return data_; }

    // A 1-D array of the first `count` entries. The array owns the buffer from now on and
    // gives it back to the pool when it (and every view of it) is freed.
    py::array_t<int32_t> to_array(std::size_t count) {
        std::unique_ptr<PooledBuffer> owned(new PooledBuffer(data_, capacity_));
        data_ = nullptr;
        int32_t* data = owned->data_;
        const py::capsule base(owned.get(),
                               [](void* p) { delete static_cast<PooledBuffer*>(p); });
        owned.release();  // the capsule deletes it
        return py::array_t<int32_t>({static_cast<py::ssize_t>(count)}, data, base);
    }

private:
    PooledBuffer(int32_t* data, std::size_t capacity) : data_(data), capacity_(capacity) {}

    int32_t* data_ = nullptr;
    std::size_t capacity_ = 0;
};

// How often compiled work has run without the GIL: _core._gil_releases(), for the tests
// that hold short work to keeping it.
std::atomic<uint64_t> gil_releases{0};

// Runs `work` without the GIL when there is enough of it to be worth the switch.
template <class F>
void run_maybe_without_gil(bool release, F&& work) {
    if (release) {
        gil_releases.fetch_add(1, std::memory_order_relaxed);
        const py::gil_scoped_release no_gil;
        work();
    } else {
        work();
    }
}

// ---------------------------------------------------------------------------------------
// plan_transfer

// What Python sees of a kvpush::TransferPlan: the same data, as numpy arrays.
struct PyTransferPlan {
    py::array local_indices;
    py::array remote_indices;
    py::array runs;
    int64_t num_blocks;
    int64_t num_regions;
    int64_t num_runs;
    int64_t num_descriptors;
};

static_assert(std::is_standard_layout_v<kvpush::Run> && sizeof(kvpush::Run) == 3 * sizeof(int64_t),
              "runs are copied byte for byte into a (num_runs, 3) int64 array");

// Writes a core plan's index lists (np.empty-like: write_indices fills every entry, straight
// into the arrays' buffers) and wraps everything as read-only numpy arrays.
template <class Plan>
PyTransferPlan to_python(const Plan& plan, bool release, bool merges) {
    const std::size_t count = plan.num_indices();
    py::array_t<int32_t> local_indices;
    py::array_t<int32_t> remote_indices;
    if (count >= kPooledEntries) {
        PooledBuffer local(count);
        PooledBuffer remote(count);
        run_maybe_without_gil(release, [&] { plan.write_indices(local.data(), remote.data()); });
        local_indices = local.to_array(count);
        remote_indices = remote.to_array(count);
    } else {
        local_indices = py::array_t<int32_t>(static_cast<py::ssize_t>(count));
        remote_indices = py::array_t<int32_t>(static_cast<py::ssize_t>(count));
        plan.write_indices(local_indices.mutable_data(), remote_indices.mutable_data());
    }

    const auto num_runs = static_cast<py::ssize_t>(plan.runs.size());
    py::array_t<int64_t> runs({num_runs, py::ssize_t{3}});
    if (num_runs > 0) {
        std::memcpy(runs.mutable_data(), plan.runs.data(), plan.runs.size() * sizeof(kvpush::Run));
    }

    return PyTransferPlan{read_only(std::move(local_indices)),
                          read_only(std::move(remote_indices)),
                          read_only(std::move(runs)),
                          plan.num_blocks(),
                          plan.num_regions,
                          plan.num_runs(),
                          plan.num_descriptors(merges)};
}

// Plans a converted request, without the GIL when its output is large enough to be worth
// the switch. The ids stay alive without the GIL (the caller's arguments hold them), and the
// core reads each once into its own copy, so a thread writing to them cannot break the plan.
PyTransferPlan run_plan(const kvpush::PlanRequest& request, bool merges) {
    const bool release = static_cast<double>(request.local_ids.size) *
                             static_cast<double>(request.num_regions) >=
                         kReleaseGilEntries;
    kvpush::TransferPlan plan;
    kvpush::Status status;
    run_maybe_without_gil(release, [&] { status = kvpush::plan_transfer(request, &plan); });
    throw_if_error(status);
    return to_python(plan, release, merges);
}

PyTransferPlan run_split_plan(const kvpush::SplitPlanRequest& request, bool merges) {
    // Output size, n * heads * num_regions, with n the longer (fine) side; doubles, since
    // nothing is validated yet and the product may not fit an integer.
    const auto n = static_cast<double>(std::max(request.local_ids.size, request.remote_ids.size));
    const bool release = n * static_cast<double>(request.heads) *
                             static_cast<double>(request.num_regions) >=
                         kReleaseGilEntries;
    kvpush::SplitTransferPlan plan;
    kvpush::Status status;
    run_maybe_without_gil(release,
                          [&] { status = kvpush::plan_split_transfer(request, &plan); });
    throw_if_error(status);
    return to_python(plan, release, merges);
}

PyTransferPlan plan_transfer(const py::object& local_ids, const py::object& remote_ids,
                             const py::object& local_num_blocks,
                             const py::object& remote_num_blocks, const py::object& num_regions,
                             bool coalesce, bool merges) {
    // Arrays are checked before the counts are converted (the documented error order),
    // and viewed only after: a count's __index__ is arbitrary Python that could swap an
    // array's buffer or dtype in between.
    block_ids_arg(local_ids, "local_ids");
    block_ids_arg(remote_ids, "remote_ids");
    kvpush::PlanRequest request;
    request.local_num_blocks = to_int64(local_num_blocks);
    request.remote_num_blocks = to_int64(remote_num_blocks);
    request.num_regions = to_int64(num_regions);
    request.coalesce = coalesce;
    request.local_ids = block_ids_arg(local_ids, "local_ids");
    request.remote_ids = block_ids_arg(remote_ids, "remote_ids");
    return run_plan(request, merges);
}

// ---------------------------------------------------------------------------------------
// plan_split_transfer: the same TransferPlan out, from blocks split into per-head slots.

PyTransferPlan plan_split_transfer(const py::object& local_ids, const py::object& remote_ids,
                                   const py::object& local_num_blocks,
                                   const py::object& remote_num_blocks,
                                   const py::object& num_regions, const py::object& heads,
                                   const py::object& local_split,
                                   const py::object& remote_split, bool merges) {
    // Checked, converted, then viewed, for the reasons given in plan_transfer.
    block_ids_arg(local_ids, "local_ids");
    block_ids_arg(remote_ids, "remote_ids");
    kvpush::SplitPlanRequest request;
    request.local_num_blocks = to_int64(local_num_blocks);
    request.remote_num_blocks = to_int64(remote_num_blocks);
    request.num_regions = to_int64(num_regions);
    request.heads = to_int64(heads);
    request.local_split = to_int64(local_split);
    request.remote_split = to_int64(remote_split);
    request.local_ids = block_ids_arg(local_ids, "local_ids");
    request.remote_ids = block_ids_arg(remote_ids, "remote_ids");
    return run_split_plan(request, merges);
}

// ---------------------------------------------------------------------------------------
// check_block_ids: one side's ids on their own, as the engine hands them over. One call that
// validates and copies: what a plan_transfer of the ids with themselves, an astype copy
// and a flags change did before, at a fraction of the cost on a cold cache.

py::array_t<int64_t> check_block_ids(const py::object& ids, const py::object& num_blocks,
                                     const std::string& name) {
    block_ids_arg(ids, name.c_str());  // checked, converted, then viewed: see plan_transfer
    const int64_t blocks = to_int64(num_blocks);
    const kvpush::BlockIdView view = block_ids_arg(ids, name.c_str());
    py::array_t<int64_t> out(static_cast<py::ssize_t>(view.size));
    int64_t* out_data = out.mutable_data();
    kvpush::Status status;
    run_maybe_without_gil(static_cast<double>(view.size) >= kReleaseGilEntries, [&] {
        status = kvpush::check_block_ids(view, name.c_str(), blocks, out_data);
    });
    throw_if_error(status);
    return read_only(std::move(out));
}

// ---------------------------------------------------------------------------------------
// PreparedLink: a link's constants converted and checked once, at handshake; a request
// then costs one call with its two id arrays.

class PreparedLink {
public:
    PreparedLink(const py::object& local_num_blocks, const py::object& remote_num_blocks,
                 const py::object& num_regions, const py::object& heads,
                 const py::object& local_split, const py::object& remote_split, bool merges) {
        shape_.local_num_blocks = to_int64(local_num_blocks);
        shape_.remote_num_blocks = to_int64(remote_num_blocks);
        shape_.num_regions = to_int64(num_regions);
        shape_.heads = to_int64(heads);
        shape_.local_split = to_int64(local_split);
        shape_.remote_split = to_int64(remote_split);
        shape_.merges = merges;
        const kvpush::Status status = kvpush::check_link(shape_);
        if (!status.ok()) throw py::value_error(status.message);
    }

    PyTransferPlan plan(const py::object& local_ids, const py::object& remote_ids,
                        bool coalesce) const {
        if (!shape_.split()) {
            kvpush::PlanRequest request;
            request.local_ids = block_ids_arg(local_ids, "local_ids");
            request.remote_ids = block_ids_arg(remote_ids, "remote_ids");
            request.local_num_blocks = shape_.local_num_blocks;
            request.remote_num_blocks = shape_.remote_num_blocks;
            request.num_regions = shape_.num_regions;
            request.coalesce = coalesce;
            return run_plan(request, shape_.merges);
        }
        kvpush::SplitPlanRequest request;
        request.local_ids = block_ids_arg(local_ids, "local_ids");
        request.remote_ids = block_ids_arg(remote_ids, "remote_ids");
        request.local_num_blocks = shape_.local_num_blocks;
        request.remote_num_blocks = shape_.remote_num_blocks;
        request.num_regions = shape_.num_regions;
        request.heads = shape_.heads;
        request.local_split = shape_.local_split;
        request.remote_split = shape_.remote_split;
        return run_split_plan(request, shape_.merges);
    }

    const kvpush::LinkShape& shape() const { return shape_; }

private:
    kvpush::LinkShape shape_;
};

void register_plan(py::module_& m) {
    py::class_<PyTransferPlan>(m, "TransferPlan", py::is_final(),
                               "Descriptor indices for one transfer; see kvpush/_core.pyi.")
        .def_readonly("local_indices", &PyTransferPlan::local_indices)
        .def_readonly("remote_indices", &PyTransferPlan::remote_indices)
        .def_readonly("runs", &PyTransferPlan::runs)
        .def_readonly("num_blocks", &PyTransferPlan::num_blocks)
        .def_readonly("num_regions", &PyTransferPlan::num_regions)
        .def_readonly("num_runs", &PyTransferPlan::num_runs)
        .def_readonly("num_descriptors", &PyTransferPlan::num_descriptors)
        .def("__repr__", [](const PyTransferPlan& p) {
            return "TransferPlan(num_blocks=" + std::to_string(p.num_blocks) +
                   ", num_regions=" + std::to_string(p.num_regions) +
                   ", num_runs=" + std::to_string(p.num_runs) + ")";
        });

    py::class_<PreparedLink>(m, "PreparedLink", py::is_final(),
                             "A link's planning constants, checked once; see kvpush/_core.pyi.")
        .def(py::init<const py::object&, const py::object&, const py::object&,
                      const py::object&, const py::object&, const py::object&, bool>(),
             py::arg("local_num_blocks"), py::arg("remote_num_blocks"), py::arg("num_regions"),
             py::arg("heads") = 0, py::arg("local_split") = 1, py::arg("remote_split") = 1,
             py::arg("merges") = true)
        .def("plan", &PreparedLink::plan, py::arg("local_ids"), py::arg("remote_ids"),
             py::arg("coalesce") = true)
        .def_property_readonly("local_num_blocks",
                               [](const PreparedLink& l) { return l.shape().local_num_blocks; })
        .def_property_readonly("remote_num_blocks",
                               [](const PreparedLink& l) { return l.shape().remote_num_blocks; })
        .def_property_readonly("num_regions",
                               [](const PreparedLink& l) { return l.shape().num_regions; })
        .def_property_readonly("heads", [](const PreparedLink& l) { return l.shape().heads; })
        .def_property_readonly("local_split",
                               [](const PreparedLink& l) { return l.shape().local_split; })
        .def_property_readonly("remote_split",
                               [](const PreparedLink& l) { return l.shape().remote_split; })
        .def_property_readonly("merges", [](const PreparedLink& l) { return l.shape().merges; })
        .def("__repr__", [](const PreparedLink& l) {
            const kvpush::LinkShape& s = l.shape();
            return "PreparedLink(local_num_blocks=" + std::to_string(s.local_num_blocks) +
                   ", remote_num_blocks=" + std::to_string(s.remote_num_blocks) +
                   ", num_regions=" + std::to_string(s.num_regions) +
                   ", heads=" + std::to_string(s.heads) +
                   ", local_split=" + std::to_string(s.local_split) +
                   ", remote_split=" + std::to_string(s.remote_split) +
                   ", merges=" + (s.merges ? "True" : "False") + ")";
        });

    m.def("plan_transfer", &plan_transfer, py::arg("local_ids"), py::arg("remote_ids"),
          py::arg("local_num_blocks"), py::arg("remote_num_blocks"), py::arg("num_regions"),
          py::arg("coalesce") = true, py::kw_only(), py::arg("merges") = true,
          "Map and coalesce block-id pairs into NIXL descriptor indices; see kvpush/_core.pyi.");

    m.def("check_block_ids", &check_block_ids, py::arg("ids"), py::arg("num_blocks"),
          py::arg("name") = "block_ids",
          "Validate one side's block ids and return a read-only int64 copy; see "
          "kvpush/_core.pyi.");

    m.def("plan_split_transfer", &plan_split_transfer, py::arg("local_ids"), py::arg("remote_ids"),
          py::arg("local_num_blocks"), py::arg("remote_num_blocks"), py::arg("num_regions"),
          py::arg("heads"), py::arg("local_split"), py::arg("remote_split"), py::kw_only(),
          py::arg("merges") = true,
          "Map fine blocks to per-head slots of coarse blocks as NIXL descriptor indices; "
          "see kvpush/_core.pyi.");
}

// ---------------------------------------------------------------------------------------
// CompletionTable
//
// The GIL stays held: the critical sections are a hash lookup and a bit flip, cheaper
// than releasing it, and no holder of the table's mutex ever waits for the GIL.

void register_completion(py::module_& m) {
    using kvpush::Arrival;
    using kvpush::CompletionTable;

    py::native_enum<Arrival>(m, "Arrival", "enum.Enum", "What one arrive() call did.")
        .value("PENDING", Arrival::Pending)
        .value("COMPLETE", Arrival::Complete)
        .value("DUPLICATE", Arrival::Duplicate)
        .value("UNKNOWN", Arrival::Unknown)
        .value("OUT_OF_RANGE", Arrival::OutOfRange)
        .finalize();

    py::class_<CompletionTable>(m, "CompletionTable", py::is_final(),
                                "Thread-safe count of arrived parts per key; see kvpush/_core.pyi.")
        .def(py::init<>())
        .def(
            "expect",
            [](CompletionTable& t, const py::str& key, const py::object& parts) {
                // Named steps: argument evaluation order would otherwise decide which of
                // two bad arguments is reported, and the reference checks the key first.
                const std::string k(key);
                const kvpush::Status status = t.expect(k, to_int64(parts));
                // Here a bad count is a plain ValueError: it is not about block ids.
                if (status.code == kvpush::StatusCode::InvalidArgument) {
                    throw py::value_error(status.message);
                }
                throw_if_error(status);
            },
            py::arg("key"), py::arg("parts"))
        .def(
            "arrive",
            [](CompletionTable& t, const py::str& key, const py::object& part) {
                const std::string k(key);
                return t.arrive(k, to_int64(part));
            },
            py::arg("key"), py::arg("part"))
        .def(
            "remove",
            [](CompletionTable& t, const py::str& key) { return t.remove(std::string(key)); },
            py::arg("key"))
        .def(
            "progress",
            [](const CompletionTable& t, const py::str& key) -> py::object {
                const auto p = t.progress(std::string(key));
                if (!p) return py::none();
                return py::make_tuple(p->arrived, p->expected);
            },
            py::arg("key"))
        .def("__len__", &CompletionTable::size)
        .def(
            "__contains__",
            [](const CompletionTable& t, const py::str& key) {
                return t.contains(std::string(key));
            },
            py::arg("key"))
        .def("__repr__", [](const CompletionTable& t) {
            return "CompletionTable(len=" + std::to_string(t.size()) + ")";
        });
}

// ---------------------------------------------------------------------------------------
// block_checksums

const uint64_t* base_addresses_arg(const py::handle& obj, std::size_t* num_regions) {
    if (!py::isinstance<py::array>(obj) || py::reinterpret_borrow<py::array>(obj).ndim() != 1) {
        raise_invalid_block_ids("base_addresses must be a 1-D uint64 array, got " +
                                describe_non_1d(obj));
    }
    const auto arr = py::reinterpret_borrow<py::array>(obj);
    if (!py::isinstance<py::array_t<uint64_t>>(obj)) {
        raise_invalid_block_ids("base_addresses must be a 1-D uint64 array, got " +
                                std::string(py::str(arr.dtype())));
    }
    if ((arr.flags() & py::array::c_style) == 0) {
        raise_invalid_block_ids("base_addresses must be C-contiguous");
    }
    if (!is_aligned(arr)) {
        raise_invalid_block_ids("base_addresses must be aligned to its dtype's size");
    }
    *num_regions = static_cast<std::size_t>(arr.shape(0));
    return static_cast<const uint64_t*>(arr.data());
}

py::array_t<uint64_t> block_checksums(const py::object& base_addresses,
                                      const py::object& block_stride,
                                      const py::object& block_bytes, const py::object& block_ids,
                                      const py::object& num_blocks) {
    // Checked before and viewed after the counts' conversion, as in plan_transfer.
    kvpush::ChecksumRequest request;
    base_addresses_arg(base_addresses, &request.num_regions);
    block_ids_arg(block_ids, "block_ids");
    request.block_stride = to_int64(block_stride);
    request.block_bytes = to_int64(block_bytes);
    request.num_blocks = to_int64(num_blocks);
    request.base_addresses = base_addresses_arg(base_addresses, &request.num_regions);
    request.block_ids = block_ids_arg(block_ids, "block_ids");

    py::array_t<uint64_t> out(static_cast<py::ssize_t>(request.block_ids.size));
    uint64_t* out_data = out.mutable_data();
    kvpush::Status status;
    // Doubles: nothing is validated yet, and the product may not fit an integer.
    const double bytes = static_cast<double>(request.block_ids.size) *
                         static_cast<double>(request.num_regions) *
                         static_cast<double>(std::max<int64_t>(request.block_bytes, 0));
    run_maybe_without_gil(bytes >= kReleaseGilChecksumBytes,
                          [&] { status = kvpush::block_checksums(request, out_data); });
    throw_if_error(status);
    return out;
}

void register_checksum(py::module_& m) {
    m.def("block_checksums", &block_checksums, py::arg("base_addresses"), py::arg("block_stride"),
          py::arg("block_bytes"), py::arg("block_ids"), py::arg("num_blocks"),
          "One 64-bit checksum per block id over all regions; see kvpush/_core.pyi.");
}

}  // namespace

PYBIND11_MODULE(_core, m) {
    m.doc() = "Compiled core of kvpush: transfer planning, completion counting, checksums.";
    m.attr("__version__") = "0.1.0";
#ifdef KVPUSH_DEBUG
    m.attr("DEBUG") = true;
#else
    m.attr("DEBUG") = false;
#endif
    register_plan(m);
    register_completion(m);
    register_checksum(m);
    m.def("_gil_releases", [] { return gil_releases.load(std::memory_order_relaxed); },
          "How many compiled calls have let go of the GIL (a test hook).");
}
