// A copy with streaming (non-temporal) stores, for staging slots that only peers read
// (NOTE [streaming stage-in], executor.cpp). The bytes written are those of memcpy; only the
// way they reach memory differs: write-combined whole lines that go to memory and drop every
// cached copy, instead of read-for-ownership stores into the cache.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <emmintrin.h>
#define NVRAR_HAVE_STREAM_STORES 1
#else
#define NVRAR_HAVE_STREAM_STORES 0
#endif

namespace nvrar {

// Whether stream_copy uses streaming stores on this architecture (else it is memcpy).
constexpr bool kHaveStreamStores = NVRAR_HAVE_STREAM_STORES != 0;

// memcpy(dst, src, bytes), the 16-byte aligned middle of dst with streaming stores, then a store
// fence: the release store of a flag that follows orders after every byte (streaming stores are
// weakly ordered on x86; the fence makes them globally visible before any later store).
inline void stream_copy(char* dst, const char* src, size_t bytes) {
#if NVRAR_HAVE_STREAM_STORES
  const size_t head = (16 - (reinterpret_cast<uintptr_t>(dst) & 15)) & 15;
  if (bytes < head + 64) {  // too short for a whole aligned line's worth: plain stores
    std::memcpy(dst, src, bytes);
    return;
  }
  std::memcpy(dst, src, head);
  size_t i = head;
  for (; i + 64 <= bytes; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
  }
  for (; i + 16 <= bytes; i += 16)
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
  std::memcpy(dst + i, src + i, bytes - i);
  _mm_sfence();
#else
  std::memcpy(dst, src, bytes);
#endif
}

}  // namespace nvrar
