// The part of NIXL's C API (libnixl_capi.so, shipped in the nixl wheel without headers)
// that kvpush._nixlc uses, declared from NIXL's documented C API as function-pointer types:
// the library is opened at run time (dlopen) from the nixl package Python imported, so
// kvpush builds without NIXL and uses the very libnixl.so the Python binding loaded.
//
// Checked against the wheel (nixl 1.5.1, x86-64): nixl_capi_create_configured_agent reads
// the configuration below at offsets 0, 1, 4, 8, 0x10, 0x18 and 0x20 (static_asserts);
// metadata and agent names come back malloc'd (free()); a notification's bytes point into
// the map and live until it is cleared.
#pragma once

#include <cstddef>
#include <cstdint>

extern "C" {

typedef int nixl_capi_status_t;
constexpr nixl_capi_status_t NIXL_CAPI_SUCCESS = 0;
constexpr nixl_capi_status_t NIXL_CAPI_IN_PROG = 1;

typedef int nixl_capi_mem_type_t;  // 0 DRAM, 1 VRAM
typedef int nixl_capi_xfer_op_t;   // 0 READ, 1 WRITE
constexpr nixl_capi_xfer_op_t NIXL_CAPI_XFER_OP_READ = 0;
constexpr nixl_capi_xfer_op_t NIXL_CAPI_XFER_OP_WRITE = 1;

typedef struct nixl_capi_agent_s* nixl_capi_agent_t;
typedef struct nixl_capi_params_s* nixl_capi_params_t;
typedef struct nixl_capi_backend_s* nixl_capi_backend_t;
typedef struct nixl_capi_opt_args_s* nixl_capi_opt_args_t;
typedef struct nixl_capi_xfer_dlist_s* nixl_capi_xfer_dlist_t;
typedef struct nixl_capi_xfer_dlist_handle_s* nixl_capi_xfer_dlist_handle_t;
typedef struct nixl_capi_reg_dlist_s* nixl_capi_reg_dlist_t;
typedef struct nixl_capi_xfer_req_s* nixl_capi_xfer_req_t;
typedef struct nixl_capi_notif_map_s* nixl_capi_notif_map_t;

// Thread sync 0 = none (only one thread calls into an agent: kvpush's loop thread).
struct nixl_capi_agent_config_t {
    bool enable_prog_thread;
    bool enable_listen_thread;
    int listen_port;
    int thread_sync;
    uint64_t pthr_delay_us;
    uint64_t lthr_delay_us;
    bool capture_telemetry;
};
static_assert(offsetof(nixl_capi_agent_config_t, listen_port) == 4, "NIXL C API layout");
static_assert(offsetof(nixl_capi_agent_config_t, thread_sync) == 8, "NIXL C API layout");
static_assert(offsetof(nixl_capi_agent_config_t, pthr_delay_us) == 0x10, "NIXL C API layout");
static_assert(offsetof(nixl_capi_agent_config_t, capture_telemetry) == 0x20, "NIXL C API layout");

}  // extern "C"

namespace kvpush::nixlc {

// One entry per C API function kvpush calls: X(name, return, (parameters)).
#define KVPUSH_NIXL_CAPI(X)                                                                   \
    X(create_configured_agent, (const char*, const nixl_capi_agent_config_t*,                  \
                                nixl_capi_agent_t*))                                           \
    X(destroy_agent, (nixl_capi_agent_t))                                                      \
    X(create_params, (nixl_capi_params_t*))                                                    \
    X(params_add, (nixl_capi_params_t, const char*, const char*))                              \
    X(destroy_params, (nixl_capi_params_t))                                                    \
    X(create_backend, (nixl_capi_agent_t, const char*, nixl_capi_params_t,                     \
                       nixl_capi_backend_t*))                                                  \
    X(destroy_backend, (nixl_capi_backend_t))                                                  \
    X(get_local_md, (nixl_capi_agent_t, void**, size_t*))                                      \
    X(load_remote_md, (nixl_capi_agent_t, const void*, size_t, char**))                        \
    X(invalidate_remote_md, (nixl_capi_agent_t, const char*))                                  \
    X(create_reg_dlist, (nixl_capi_mem_type_t, nixl_capi_reg_dlist_t*))                        \
    X(reg_dlist_add_desc, (nixl_capi_reg_dlist_t, uintptr_t, size_t, uint64_t, const void*,    \
                           size_t))                                                            \
    X(destroy_reg_dlist, (nixl_capi_reg_dlist_t))                                              \
    X(register_mem, (nixl_capi_agent_t, nixl_capi_reg_dlist_t, nixl_capi_opt_args_t))          \
    X(deregister_mem, (nixl_capi_agent_t, nixl_capi_reg_dlist_t, nixl_capi_opt_args_t))        \
    X(create_xfer_dlist, (nixl_capi_mem_type_t, nixl_capi_xfer_dlist_t*))                      \
    X(xfer_dlist_add_desc, (nixl_capi_xfer_dlist_t, uintptr_t, size_t, uint64_t))              \
    X(destroy_xfer_dlist, (nixl_capi_xfer_dlist_t))                                            \
    X(prep_xfer_dlist, (nixl_capi_agent_t, const char*, nixl_capi_xfer_dlist_t,                \
                        nixl_capi_xfer_dlist_handle_t*, nixl_capi_opt_args_t))                 \
    X(release_xfer_dlist_handle, (nixl_capi_agent_t, nixl_capi_xfer_dlist_handle_t))           \
    X(make_xfer_req, (nixl_capi_agent_t, nixl_capi_xfer_op_t, nixl_capi_xfer_dlist_handle_t,   \
                      const int*, size_t, nixl_capi_xfer_dlist_handle_t, const int*, size_t,   \
                      nixl_capi_xfer_req_t*, nixl_capi_opt_args_t))                            \
    X(create_xfer_req, (nixl_capi_agent_t, nixl_capi_xfer_op_t, nixl_capi_xfer_dlist_t,        \
                        nixl_capi_xfer_dlist_t, const char*, nixl_capi_xfer_req_t*,            \
                        nixl_capi_opt_args_t))                                                 \
    X(post_xfer_req, (nixl_capi_agent_t, nixl_capi_xfer_req_t, nixl_capi_opt_args_t))          \
    X(get_xfer_status, (nixl_capi_agent_t, nixl_capi_xfer_req_t))                              \
    X(release_xfer_req, (nixl_capi_agent_t, nixl_capi_xfer_req_t))                             \
    X(destroy_xfer_req, (nixl_capi_xfer_req_t))                                                \
    X(create_opt_args, (nixl_capi_opt_args_t*))                                                \
    X(destroy_opt_args, (nixl_capi_opt_args_t))                                                \
    X(opt_args_set_notif_msg, (nixl_capi_opt_args_t, const void*, size_t))                     \
    X(opt_args_set_has_notif, (nixl_capi_opt_args_t, bool))                                    \
    X(create_notif_map, (nixl_capi_notif_map_t*))                                              \
    X(destroy_notif_map, (nixl_capi_notif_map_t))                                              \
    X(get_notifs, (nixl_capi_agent_t, nixl_capi_notif_map_t, nixl_capi_opt_args_t))            \
    X(notif_map_size, (nixl_capi_notif_map_t, size_t*))                                        \
    X(notif_map_get_agent_at, (nixl_capi_notif_map_t, size_t, const char**))                   \
    X(notif_map_get_notifs_size, (nixl_capi_notif_map_t, const char*, size_t*))                \
    X(notif_map_get_notif, (nixl_capi_notif_map_t, const char*, size_t, const void**,          \
                            size_t*))                                                          \
    X(notif_map_clear, (nixl_capi_notif_map_t))                                                \
    X(gen_notif, (nixl_capi_agent_t, const char*, const void*, size_t, nixl_capi_opt_args_t))

// The functions, resolved by Api::load.
struct Api {
#define KVPUSH_NIXL_FIELD(name, params) nixl_capi_status_t(*name) params = nullptr;
    KVPUSH_NIXL_CAPI(KVPUSH_NIXL_FIELD)
#undef KVPUSH_NIXL_FIELD
};

}  // namespace kvpush::nixlc
