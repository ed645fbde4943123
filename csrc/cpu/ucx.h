// The CPU executor's link between hosts over UCX (csrc/cpu/ucx.cpp): the HostLink of
// host_link.h, for the ranks of a communicator that run on other hosts.
//
// UCX is an optional dependency (`pip install 'nvrar[ucx]'`, the libucx-cu12 wheel): nvrar._C is
// compiled against the wheel's headers (in the build environment) but never linked to it;
// libucp is opened with dlopen at run time, from the path Python finds (nvrar/_setup.py). So the
// module builds and imports without UCX, and a communicator across hosts without it raises
// NvrarError naming the extra.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "host_link.h"

namespace nvrar {

// Opens UCX (libucp at `libucp`) and a worker whose messages land in my segment, each only where
// `accept` allows. `remote[r]`: rank r runs on another host (an endpoint is made to it in
// connect). `net_device` (may be empty): the UCX device list to use when the user set none
// (UCX_NET_DEVICES wins). On return *blob holds what every peer needs to reach me (the worker's
// address). Throws NvrarError (UCX missing, or failing).
std::unique_ptr<HostLink> open_ucx_link(const std::string& libucp, int rank, const std::vector<bool>& remote,
                                        char* segment, size_t segment_bytes, const std::string& net_device,
                                        const RemoteWriteCheck& accept, std::string* blob);

// Whether this module was compiled with UCX's headers (else open_ucx_link always throws).
bool ucx_compiled();

}  // namespace nvrar
