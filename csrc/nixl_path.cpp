// kvpush._nixlc: a NIXL agent driven through NIXL's C API (csrc/nixl/nixl_capi.hpp) with the
// GIL released around every call into NIXL, so that a post's copy, a preparation of
// thousands of descriptors and a poll never stop the engine's Python threads. It offers
// the subset of the Python binding's agent (nixl._api.nixl_agent) that kvpush.agent.Agent
// calls, with the same arguments and results, so Agent runs over either unchanged
// (TransportConfig.nixl_api). Like the binding's agent, one thread at a time calls it.
#include <dlfcn.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <time.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "nixl/nixl_capi.hpp"

namespace py = pybind11;

namespace {

using kvpush::nixlc::Api;

Api g_api;
bool g_loaded = false;

class NixlError : public std::runtime_error {
   public:
    using std::runtime_error::runtime_error;
};

const Api& api() {
    if (!g_loaded) throw NixlError("kvpush._nixlc: NIXL's C API is not loaded (call load())");
    return g_api;
}

void check(nixl_capi_status_t status, const char* what) {
    if (status != NIXL_CAPI_SUCCESS && status != NIXL_CAPI_IN_PROG) {
        throw NixlError(std::string("NIXL C API ") + what + " failed (status " +
                        std::to_string(status) + ")");
    }
}

// Resolves every function of the header from libnixl_capi.so at ``path``; the library is
// kept loaded for the life of the process (agents may outlive any caller).
void load(const std::string& path) {
    if (g_loaded) return;
    void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) throw NixlError(std::string("cannot open NIXL's C API: ") + dlerror());
    Api resolved;
#define KVPUSH_NIXL_RESOLVE(name, params)                                                 \
    resolved.name = reinterpret_cast<decltype(resolved.name)>(dlsym(lib, "nixl_capi_" #name)); \
    if (resolved.name == nullptr) throw NixlError("NIXL's C API lacks nixl_capi_" #name);
    KVPUSH_NIXL_CAPI(KVPUSH_NIXL_RESOLVE)
#undef KVPUSH_NIXL_RESOLVE
    g_api = resolved;
    g_loaded = true;
}

// CPU time that threads spend inside NIXL with the GIL let go, summed over the process while
// counting is on (count_released): a thread's CPU less this is an upper bound on the GIL it
// held. Off by default, so a call costs no clock reads.
std::atomic<bool> g_counting{false};
std::atomic<uint64_t> g_released_ns{0};

uint64_t thread_cpu_ns() {
    timespec ts{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return static_cast<uint64_t>(ts.tv_sec) * 1000000000ULL + static_cast<uint64_t>(ts.tv_nsec);
}

// Lets the GIL go for the scope of a call into NIXL. Members are made in order and unmade in
// reverse, and the destructor's body runs before them: the clock is read after the GIL is let
// go and before it is taken back, so waiting for the GIL is not counted as released.
class NoGil {
   public:
    NoGil() = default;
    ~NoGil() {
        if (counting_) g_released_ns.fetch_add(thread_cpu_ns() - start_, std::memory_order_relaxed);
    }
    NoGil(const NoGil&) = delete;
    NoGil& operator=(const NoGil&) = delete;

   private:
    py::gil_scoped_release release_;
    bool counting_ = g_counting.load(std::memory_order_relaxed);
    uint64_t start_ = counting_ ? thread_cpu_ns() : 0;
};

nixl_capi_mem_type_t mem_type(const std::string& mem) {
    if (mem == "DRAM" || mem == "cpu") return 0;
    if (mem == "VRAM" || mem == "cuda") return 1;
    throw NixlError("kvpush._nixlc: memory kind " + mem + " is not DRAM or VRAM");
}

nixl_capi_xfer_op_t xfer_op(const std::string& op) {
    if (op == "WRITE") return NIXL_CAPI_XFER_OP_WRITE;
    if (op == "READ") return NIXL_CAPI_XFER_OP_READ;
    throw NixlError("kvpush._nixlc: operation " + op + " is not READ or WRITE");
}

const char* state_name(nixl_capi_status_t status) {
    return status == NIXL_CAPI_SUCCESS ? "DONE" : status == NIXL_CAPI_IN_PROG ? "PROC" : "ERR";
}

// The agent and what it owns; handles keep it alive until the last of them is gone.
struct State {
    nixl_capi_agent_t agent = nullptr;
    std::vector<nixl_capi_backend_t> backends;
    nixl_capi_notif_map_t notifs = nullptr;

    ~State() {
        if (notifs != nullptr) g_api.destroy_notif_map(notifs);
        if (agent != nullptr) g_api.destroy_agent(agent);
        for (auto* backend : backends) g_api.destroy_backend(backend);  // the wrappers only
    }
};
using StatePtr = std::shared_ptr<State>;

// Optional arguments carrying a notification, or none (nullptr) without one.
struct OptArgs {
    nixl_capi_opt_args_t args = nullptr;
    explicit OptArgs(const std::string& notif) {
        if (notif.empty()) return;
        check(api().create_opt_args(&args), "create_opt_args");
        check(g_api.opt_args_set_notif_msg(args, notif.data(), notif.size()), "set_notif_msg");
        check(g_api.opt_args_set_has_notif(args, true), "set_has_notif");
    }
    ~OptArgs() {
        if (args != nullptr) g_api.destroy_opt_args(args);
    }
    OptArgs(const OptArgs&) = delete;
    OptArgs& operator=(const OptArgs&) = delete;
};

using Table = py::array_t<uint64_t, py::array::c_style | py::array::forcecast>;
using Indices = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;

// A descriptor list built from rows of (address, length, device).
nixl_capi_xfer_dlist_t make_xfer_dlist(const Table& table, const std::string& mem) {
    if (table.ndim() != 2 || table.shape(1) != 3) {
        throw NixlError("kvpush._nixlc: a descriptor table has rows of (address, length, device)");
    }
    nixl_capi_xfer_dlist_t dlist = nullptr;
    check(api().create_xfer_dlist(mem_type(mem), &dlist), "create_xfer_dlist");
    auto rows = table.unchecked<2>();
    for (py::ssize_t i = 0; i < rows.shape(0); ++i) {
        const nixl_capi_status_t st = g_api.xfer_dlist_add_desc(
            dlist, static_cast<uintptr_t>(rows(i, 0)), static_cast<size_t>(rows(i, 1)), rows(i, 2));
        if (st != NIXL_CAPI_SUCCESS) {
            g_api.destroy_xfer_dlist(dlist);
            check(st, "xfer_dlist_add_desc");
        }
    }
    return dlist;
}

struct Registration {
    StatePtr state;
    nixl_capi_reg_dlist_t dlist = nullptr;
    ~Registration() {
        if (dlist != nullptr) g_api.destroy_reg_dlist(dlist);
    }
};

struct DlistHandle {
    StatePtr state;
    nixl_capi_xfer_dlist_handle_t handle = nullptr;

    void release() {
        if (handle == nullptr) return;
        nixl_capi_status_t st;
        {
            NoGil nogil;
            st = g_api.release_xfer_dlist_handle(state->agent, handle);
        }
        handle = nullptr;
        check(st, "release_xfer_dlist_handle");
    }
    ~DlistHandle() {
        if (handle != nullptr) g_api.release_xfer_dlist_handle(state->agent, handle);
    }
};

struct XferDescs {
    nixl_capi_xfer_dlist_t dlist = nullptr;
    ~XferDescs() {
        if (dlist != nullptr) g_api.destroy_xfer_dlist(dlist);
    }
};

struct XferHandle {
    StatePtr state;
    nixl_capi_xfer_req_t req = nullptr;

    // Releases (cancelling if still active); raises when NIXL cannot, the handle then kept.
    void release() {
        if (req == nullptr) return;
        nixl_capi_status_t st;
        {
            NoGil nogil;
            st = g_api.release_xfer_req(state->agent, req);
        }
        check(st, "release_xfer_req");
        g_api.destroy_xfer_req(req);
        req = nullptr;
    }
    ~XferHandle() {
        // Dropped without release(): NIXL cancels it if it can; if not, the wrapper is kept
        // (NIXL still owns the request).
        if (req != nullptr && g_api.release_xfer_req(state->agent, req) == NIXL_CAPI_SUCCESS) {
            g_api.destroy_xfer_req(req);
        }
    }
};

nixl_capi_xfer_req_t live(const XferHandle& handle) {
    if (handle.req == nullptr) throw NixlError("kvpush._nixlc: the transfer handle was released");
    return handle.req;
}

class NixlAgent {
   public:
    explicit NixlAgent(const std::string& name) : state_(std::make_shared<State>()) {
        nixl_capi_agent_config_t config{};  // no progress or listen thread, no thread sync
        check(api().create_configured_agent(name.c_str(), &config, &state_->agent),
              "create_configured_agent");
        check(g_api.create_notif_map(&state_->notifs), "create_notif_map");
    }

    void create_backend(const std::string& backend, const std::map<std::string, std::string>& params) {
        nixl_capi_params_t p = nullptr;
        check(g_api.create_params(&p), "create_params");
        for (const auto& [key, value] : params) {
            const nixl_capi_status_t st = g_api.params_add(p, key.c_str(), value.c_str());
            if (st != NIXL_CAPI_SUCCESS) {
                g_api.destroy_params(p);
                check(st, "params_add");
            }
        }
        nixl_capi_backend_t handle = nullptr;
        const nixl_capi_status_t st = g_api.create_backend(state_->agent, backend.c_str(), p, &handle);
        g_api.destroy_params(p);
        check(st, "create_backend");
        state_->backends.push_back(handle);
    }

    std::shared_ptr<Registration> register_memory(
        const std::vector<std::tuple<uint64_t, uint64_t, uint64_t, std::string>>& regions,
        const std::string& mem) {
        auto reg = std::make_shared<Registration>();
        reg->state = state_;
        check(g_api.create_reg_dlist(mem_type(mem), &reg->dlist), "create_reg_dlist");
        for (const auto& [addr, len, dev, meta] : regions) {
            check(g_api.reg_dlist_add_desc(reg->dlist, static_cast<uintptr_t>(addr), len, dev,
                                           meta.data(), meta.size()),
                  "reg_dlist_add_desc");
        }
        check(g_api.register_mem(state_->agent, reg->dlist, nullptr), "register_mem");
        return reg;
    }

    void deregister_memory(Registration& reg) {
        check(g_api.deregister_mem(state_->agent, reg.dlist, nullptr), "deregister_mem");
    }

    py::bytes get_agent_metadata() {
        void* data = nullptr;
        size_t len = 0;
        check(g_api.get_local_md(state_->agent, &data, &len), "get_local_md");
        py::bytes out(static_cast<const char*>(data), len);
        std::free(data);
        return out;
    }

    std::string add_remote_agent(const std::string& metadata) {
        char* name = nullptr;
        nixl_capi_status_t st;
        {
            NoGil nogil;
            st = g_api.load_remote_md(state_->agent, metadata.data(), metadata.size(), &name);
        }
        check(st, "load_remote_md");
        std::string out(name != nullptr ? name : "");
        std::free(name);
        return out;
    }

    void remove_remote_agent(const std::string& name) {
        nixl_capi_status_t st;
        {
            NoGil nogil;
            st = g_api.invalidate_remote_md(state_->agent, name.c_str());
        }
        check(st, "invalidate_remote_md");
    }

    std::shared_ptr<DlistHandle> prep_xfer_dlist(const std::string& agent_name, const Table& table,
                                                 const std::string& mem) {
        XferDescs descs;
        descs.dlist = make_xfer_dlist(table, mem);
        auto out = std::make_shared<DlistHandle>();
        out->state = state_;
        // Local lists are prepared for the initiator itself: NIXL names it by the empty name.
        const std::string name = agent_name == "NIXL_INIT_AGENT" ? "" : agent_name;
        nixl_capi_status_t st;
        {
            NoGil nogil;
            st = g_api.prep_xfer_dlist(state_->agent, name.c_str(), descs.dlist, &out->handle, nullptr);
        }
        check(st, "prep_xfer_dlist");
        return out;
    }

    std::shared_ptr<XferDescs> get_xfer_descs(const Table& table, const std::string& mem) {
        auto out = std::make_shared<XferDescs>();
        out->dlist = make_xfer_dlist(table, mem);
        return out;
    }

    std::shared_ptr<XferHandle> make_prepped_xfer(const std::string& op, const DlistHandle& local,
                                                  const Indices& local_idx, const DlistHandle& remote,
                                                  const Indices& remote_idx, const std::string& notif) {
        const nixl_capi_xfer_op_t operation = xfer_op(op);
        if (local.handle == nullptr || remote.handle == nullptr) {
            throw NixlError("kvpush._nixlc: a descriptor list handle was released");
        }
        OptArgs args(notif);
        auto out = std::make_shared<XferHandle>();
        out->state = state_;
        const int* li = local_idx.data();
        const int* ri = remote_idx.data();
        const auto ln = static_cast<size_t>(local_idx.size());
        const auto rn = static_cast<size_t>(remote_idx.size());
        nixl_capi_status_t st;
        {
            NoGil nogil;  // the arrays stay referenced by the caller's frame
            st = g_api.make_xfer_req(state_->agent, operation, local.handle, li, ln, remote.handle,
                                     ri, rn, &out->req, args.args);
        }
        check(st, "make_xfer_req");
        return out;
    }

    std::shared_ptr<XferHandle> initialize_xfer(const std::string& op, const XferDescs& local,
                                                const XferDescs& remote, const std::string& peer,
                                                const std::string& notif) {
        const nixl_capi_xfer_op_t operation = xfer_op(op);
        OptArgs args(notif);
        auto out = std::make_shared<XferHandle>();
        out->state = state_;
        nixl_capi_status_t st;
        {
            NoGil nogil;
            st = g_api.create_xfer_req(state_->agent, operation, local.dlist, remote.dlist,
                                       peer.c_str(), &out->req, args.args);
        }
        check(st, "create_xfer_req");
        return out;
    }

    // "DONE", "PROC" or "ERR", as the binding's agent says.
    std::string transfer(const XferHandle& handle) {
        nixl_capi_xfer_req_t req = live(handle);
        nixl_capi_status_t st;
        {
            NoGil nogil;
            st = g_api.post_xfer_req(state_->agent, req, nullptr);
        }
        return state_name(st);
    }

    std::string check_xfer_state(const XferHandle& handle) {
        nixl_capi_xfer_req_t req = live(handle);
        nixl_capi_status_t st;
        {
            NoGil nogil;
            st = g_api.get_xfer_status(state_->agent, req);
        }
        return state_name(st);
    }

    // New notifications by sender (also progresses the agent).
    py::dict get_new_notifs() {
        nixl_capi_notif_map_t map = state_->notifs;
        size_t senders = 0;
        nixl_capi_status_t st;
        {
            NoGil nogil;
            st = g_api.notif_map_clear(map);
            if (st == NIXL_CAPI_SUCCESS) st = g_api.get_notifs(state_->agent, map, nullptr);
            if (st == NIXL_CAPI_SUCCESS) st = g_api.notif_map_size(map, &senders);
        }
        check(st, "get_notifs");
        py::dict out;
        for (size_t i = 0; i < senders; ++i) {
            const char* sender = nullptr;
            size_t count = 0;
            check(g_api.notif_map_get_agent_at(map, i, &sender), "notif_map_get_agent_at");
            check(g_api.notif_map_get_notifs_size(map, sender, &count), "notif_map_get_notifs_size");
            py::list notes;
            for (size_t j = 0; j < count; ++j) {
                const void* data = nullptr;
                size_t len = 0;
                check(g_api.notif_map_get_notif(map, sender, j, &data, &len), "notif_map_get_notif");
                notes.append(py::bytes(static_cast<const char*>(data), len));
            }
            out[py::str(sender)] = notes;
        }
        return out;
    }

    void send_notif(const std::string& peer, const std::string& message) {
        nixl_capi_status_t st;
        {
            NoGil nogil;
            st = g_api.gen_notif(state_->agent, peer.c_str(), message.data(), message.size(), nullptr);
        }
        check(st, "gen_notif");
    }

   private:
    StatePtr state_;
};

}  // namespace

PYBIND11_MODULE(_nixlc, m) {
    m.doc() = "A NIXL agent over NIXL's C API, every call into NIXL without the GIL";
    py::register_exception<NixlError>(m, "NixlError", PyExc_RuntimeError);
    m.def("load", &load, py::arg("path"),
          "Open NIXL's C API (libnixl_capi.so at path); once per process");
    m.def("loaded", [] { return g_loaded; }, "Whether load() succeeded");
    m.def(
        "count_released", [](bool on) { g_counting.store(on, std::memory_order_relaxed); },
        py::arg("on"),
        "Count (or stop counting) the CPU time threads spend inside NIXL without the GIL");
    m.def(
        "released_cpu_ns", [] { return g_released_ns.load(std::memory_order_relaxed); },
        "CPU ns threads of this process spent inside NIXL without the GIL while counting was on");

    py::class_<Registration, std::shared_ptr<Registration>>(m, "Registration");
    py::class_<XferDescs, std::shared_ptr<XferDescs>>(m, "XferDescs");
    py::class_<DlistHandle, std::shared_ptr<DlistHandle>>(m, "DlistHandle")
        .def("release", &DlistHandle::release);
    py::class_<XferHandle, std::shared_ptr<XferHandle>>(m, "XferHandle")
        .def("release", &XferHandle::release);
    py::class_<NixlAgent>(m, "NixlAgent")
        .def(py::init<const std::string&>(), py::arg("name"))
        .def("create_backend", &NixlAgent::create_backend)
        .def("register_memory", &NixlAgent::register_memory)
        .def("deregister_memory", &NixlAgent::deregister_memory)
        .def("get_agent_metadata", &NixlAgent::get_agent_metadata)
        .def("add_remote_agent", &NixlAgent::add_remote_agent)
        .def("remove_remote_agent", &NixlAgent::remove_remote_agent)
        .def("prep_xfer_dlist", &NixlAgent::prep_xfer_dlist)
        .def("get_xfer_descs", &NixlAgent::get_xfer_descs)
        .def("make_prepped_xfer", &NixlAgent::make_prepped_xfer)
        .def("initialize_xfer", &NixlAgent::initialize_xfer)
        .def("transfer", &NixlAgent::transfer)
        .def("check_xfer_state", &NixlAgent::check_xfer_state)
        .def("get_new_notifs", &NixlAgent::get_new_notifs)
        .def("send_notif", &NixlAgent::send_notif);
}
