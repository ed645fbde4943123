// The host half of the emulation layer: the CUDA runtime API that the GPU executor's host code
// (csrc/cuda/runtime.cu, allreduce.cu, fused.cu, the instance units) calls, emulated on the
// host (scripts/emulate.sh --host; docs/gpu/emulation.md, "Host half"). Found before the real
// header only through the host build's include path (-Icsrc/emu/host); the GPU build never sees
// it. Implementation: csrc/emu/host_emu.cpp.
//
//   devices        one emulated device per PE (the PE a host thread is bound to: host_emu.h)
//   memory         device and host-mapped memory are host memory (a device pointer is a host one)
//   streams        each stream runs its work on a thread of its own, asynchronously to the host
//                  (a missing synchronization shows); the legacy stream (0) orders with every
//                  blocking stream of its PE as CUDA's does; cudaMemset is asynchronous
//   events         a record is a point in a stream's work; a wait is a dependency on it
//   graphs         capture records the work enqueued on a capturing stream; a launch replays it
//                  on the launch stream; external event nodes are resolved at each launch
//   capture rules  what CUDA refuses while a capture in global mode is active on the PE: the
//                  legacy stream (cudaErrorStreamCaptureImplicit), synchronizing a capturing
//                  stream or the device, a function-attribute query (a lazy module load), an
//                  internal event wait on an event from outside the capture; each invalidates it
//   kernels        a launch starts the kernel on the emulated device (World::launch_pe) when the
//                  stream reaches it; a trap leaves the PE's context with a sticky error
#pragma once

#include <cstddef>
#include <cstdint>

#if !defined(NVRAR_EMULATE)
#error "csrc/emu/host/cuda_runtime.h is the host emulation: build with -DNVRAR_EMULATE"
#endif

// The architectures the module was built for (setup.py passes the GPU build's): the emulated
// device stands for an sm_90.
#ifndef NVRAR_CUDA_ARCHS
#define NVRAR_CUDA_ARCHS "90"
#endif

enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInitializationError = 3,
  cudaErrorInvalidDevice = 101,
  cudaErrorNoDevice = 100,
  cudaErrorInvalidResourceHandle = 400,
  cudaErrorNotSupported = 801,
  cudaErrorStreamCaptureUnsupported = 900,
  cudaErrorStreamCaptureInvalidated = 901,
  cudaErrorStreamCaptureIsolation = 903,
  cudaErrorStreamCaptureImplicit = 904,
  cudaErrorLaunchFailure = 719,
  cudaErrorCooperativeLaunchTooLarge = 720,
  cudaErrorTimeout = 909,
};

struct CUstream_st;
struct CUevent_st;
struct CUgraph_st;
struct CUgraphExec_st;
using cudaStream_t = CUstream_st*;
using cudaEvent_t = CUevent_st*;
using cudaGraph_t = CUgraph_st*;
using cudaGraphExec_t = CUgraphExec_st*;

enum cudaStreamCaptureStatus {
  cudaStreamCaptureStatusNone = 0,
  cudaStreamCaptureStatusActive = 1,
  cudaStreamCaptureStatusInvalidated = 2,
};
enum cudaStreamCaptureMode {
  cudaStreamCaptureModeGlobal = 0,
  cudaStreamCaptureModeThreadLocal = 1,
  cudaStreamCaptureModeRelaxed = 2,
};
enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4,
};

constexpr unsigned cudaEventDefault = 0x0;
constexpr unsigned cudaEventDisableTiming = 0x2;
constexpr unsigned cudaHostAllocMapped = 0x2;
constexpr unsigned cudaEventWaitDefault = 0x0;
constexpr unsigned cudaEventWaitExternal = 0x1;
constexpr unsigned cudaEventRecordDefault = 0x0;
constexpr unsigned cudaEventRecordExternal = 0x1;
constexpr unsigned cudaStreamDefault = 0x0;
constexpr unsigned cudaStreamNonBlocking = 0x1;

struct cudaFuncAttributes {
  int maxThreadsPerBlock;
  int numRegs;
};

const char* cudaGetErrorString(cudaError_t e);
cudaError_t cudaGetLastError();
cudaError_t cudaGetDeviceCount(int* n);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaFree(void* p);
cudaError_t cudaMalloc(void** p, size_t bytes);
template <typename T>
inline cudaError_t cudaMalloc(T** p, size_t bytes) {
  return cudaMalloc(reinterpret_cast<void**>(p), bytes);
}
cudaError_t cudaHostAlloc(void** p, size_t bytes, unsigned flags);
template <typename T>
inline cudaError_t cudaHostAlloc(T** p, size_t bytes, unsigned flags) {
  return cudaHostAlloc(reinterpret_cast<void**>(p), bytes, flags);
}
cudaError_t cudaHostGetDevicePointer(void** dev, void* host, unsigned flags);
template <typename T>
inline cudaError_t cudaHostGetDevicePointer(T** dev, void* host, unsigned flags) {
  return cudaHostGetDevicePointer(reinterpret_cast<void**>(dev), host, flags);
}
cudaError_t cudaFreeHost(void* p);
cudaError_t cudaMemset(void* p, int value, size_t bytes);
cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind);
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, cudaStream_t s = nullptr);
cudaError_t cudaDeviceSynchronize();

cudaError_t cudaStreamCreate(cudaStream_t* s);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned flags);
cudaError_t cudaStreamDestroy(cudaStream_t s);
cudaError_t cudaStreamSynchronize(cudaStream_t s);
cudaError_t cudaStreamIsCapturing(cudaStream_t s, cudaStreamCaptureStatus* status);
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags = 0);
cudaError_t cudaStreamBeginCapture(cudaStream_t s, cudaStreamCaptureMode mode);
cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t* graph);

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned flags);
cudaError_t cudaEventDestroy(cudaEvent_t e);
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s = nullptr);
cudaError_t cudaEventRecordWithFlags(cudaEvent_t e, cudaStream_t s = nullptr, unsigned flags = 0);
cudaError_t cudaEventSynchronize(cudaEvent_t e);

cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph, unsigned long long flags = 0);
cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t s);
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec);
cudaError_t cudaGraphDestroy(cudaGraph_t graph);

// A kernel's attributes (the emulated device's limit, or a failure the driver injected).
cudaError_t nvrar_emu_func_attributes(cudaFuncAttributes* a);
template <typename F>
inline cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* a, F*) {
  return nvrar_emu_func_attributes(a);
}
