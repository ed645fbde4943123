// Low-latency (LL) packets for the inter-node steps on small shards: every 8-byte packet carries
// 4 bytes of payload and a 32-bit flag, so a receiver knows data has arrived without a separate
// signal (one network latency instead of two), at the cost of twice the bytes on the wire; the
// selector therefore uses LL only for shards up to a small size and put-with-signal above it.
//
// The flag is the low 32 bits of the round's flag word: 16 bits of epoch, 16 bits of call
// signature. A packet left from round e-2 in the same parity slot has other epoch bits and is not
// taken for new; equal epoch bits with another signature are a call mismatch. Relies on 8-byte
// stores arriving whole (NVLink, InfiniBand; the CPU executor's aligned 64-bit stores).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "../common/hd.h"
#include "plan.h"

namespace nvrar {

constexpr size_t kLLPayload = 4;  // payload bytes per 8-byte packet

// At least one packet, also for an empty shard: every inter-node step stays a rendezvous (the
// parity argument of NOTE [epoch protocol] needs F3 for every slice, empty or not).
NVRAR_HD size_t ll_packets(size_t bytes) { return bytes == 0 ? 1 : ceil_div(bytes, kLLPayload); }
NVRAR_HD size_t ll_wire_bytes(size_t bytes) { return ll_packets(bytes) * 8; }
NVRAR_HD uint32_t ll_flag(uint64_t epoch, uint32_t sig) { return static_cast<uint32_t>(flag_word(epoch, sig)); }

// Packet i of a payload: bytes [4i, 4i + 4) (zero-padded past the end) with the flag on top.
NVRAR_HD uint64_t ll_make_packet(const char* payload, size_t bytes, size_t i, uint32_t flag) {
  uint32_t data = 0;
  const size_t off = i * kLLPayload;
  if (off + kLLPayload <= bytes) {
#if NVRAR_ON_DEVICE
    if ((reinterpret_cast<size_t>(payload + off) & 3) == 0) {
      data = *reinterpret_cast<const uint32_t*>(payload + off);
    } else {
      const unsigned char* p = reinterpret_cast<const unsigned char*>(payload + off);
      data = static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) | (static_cast<uint32_t>(p[2]) << 16) |
             (static_cast<uint32_t>(p[3]) << 24);
    }
#else
    std::memcpy(&data, payload + off, kLLPayload);
#endif
  } else {
    for (size_t k = 0; off + k < bytes; ++k)
      data |= static_cast<uint32_t>(static_cast<unsigned char>(payload[off + k])) << (8 * k);
  }
  return (static_cast<uint64_t>(flag) << 32) | data;
}

// Vector packing: a quad is packets 4q .. 4q+3, 16 payload bytes and 32 wire bytes, so that one
// thread moves its payload with one 16-byte load and its packets with two 16-byte stores (each
// 8-byte half of a vector store still arrives whole). Packets past ll_packets(bytes) belong to
// no quad member: ll_quad_size says how many of the 4 are real.
constexpr size_t kLLQuad = 4;
NVRAR_HD size_t ll_quads(size_t bytes) { return ceil_div(ll_packets(bytes), kLLQuad); }
NVRAR_HD size_t ll_quad_size(size_t bytes, size_t q) {
  const size_t n = ll_packets(bytes);
  return n - q * kLLQuad < kLLQuad ? n - q * kLLQuad : kLLQuad;
}

// The packets of quad q; the same words as ll_make_packet(payload, bytes, 4q + k, flag) for every
// k < ll_quad_size(bytes, q) (the others are left untouched).
NVRAR_HD void ll_make_quad(const char* payload, size_t bytes, size_t q, uint32_t flag, uint64_t (&pk)[kLLQuad]) {
  const size_t off = q * kLLQuad * kLLPayload;
  const uint64_t hi = static_cast<uint64_t>(flag) << 32;
  if (off + kLLQuad * kLLPayload <= bytes && (reinterpret_cast<size_t>(payload + off) & 15) == 0) {
    uint32_t w[kLLQuad];
#if NVRAR_ON_DEVICE
    const uint4 u = *reinterpret_cast<const uint4*>(payload + off);
    w[0] = u.x;
    w[1] = u.y;
    w[2] = u.z;
    w[3] = u.w;
#else
    std::memcpy(w, payload + off, sizeof(w));
#endif
    for (size_t k = 0; k < kLLQuad; ++k) pk[k] = hi | w[k];
    return;
  }
  const size_t m = ll_quad_size(bytes, q);
  for (size_t k = 0; k < m; ++k) pk[k] = ll_make_packet(payload, bytes, q * kLLQuad + k, flag);
}

NVRAR_HD uint32_t ll_packet_flag(uint64_t packet) { return static_cast<uint32_t>(packet >> 32); }

// State of a packet for a receiver expecting `flag`: 1 arrived, 0 not yet (empty or older round),
// -1 same round but another call signature (mismatch).
NVRAR_HD int ll_packet_state(uint64_t packet, uint32_t flag) {
  const uint32_t f = ll_packet_flag(packet);
  if (f == flag) return 1;
  if ((f >> kSigBits) == (flag >> kSigBits) && f != 0) return -1;
  return 0;
}

// Payload bytes of packet i, written to dst (only the bytes inside `bytes`).
NVRAR_HD void ll_store_payload(char* dst, size_t bytes, size_t i, uint64_t packet) {
  const uint32_t data = static_cast<uint32_t>(packet);
  const size_t off = i * kLLPayload;
  if (off + kLLPayload <= bytes) {
#if NVRAR_ON_DEVICE
    if ((reinterpret_cast<size_t>(dst + off) & 3) == 0) {
      *reinterpret_cast<uint32_t*>(dst + off) = data;
      return;
    }
#else
    std::memcpy(dst + off, &data, kLLPayload);
    return;
#endif
  }
  for (size_t k = 0; k < kLLPayload && off + k < bytes; ++k) dst[off + k] = static_cast<char>((data >> (8 * k)) & 0xffu);
}

// Payload of quad q (its ll_quad_size(bytes, q) packets), written to dst: one 16-byte store where
// the quad is whole and dst aligned, packet by packet otherwise. The same bytes either way.
NVRAR_HD void ll_store_quad(char* dst, size_t bytes, size_t q, const uint64_t (&pk)[kLLQuad]) {
  const size_t off = q * kLLQuad * kLLPayload;
  if (off + kLLQuad * kLLPayload <= bytes && (reinterpret_cast<size_t>(dst + off) & 15) == 0) {
#if NVRAR_ON_DEVICE
    uint4 u;
    u.x = static_cast<uint32_t>(pk[0]);
    u.y = static_cast<uint32_t>(pk[1]);
    u.z = static_cast<uint32_t>(pk[2]);
    u.w = static_cast<uint32_t>(pk[3]);
    *reinterpret_cast<uint4*>(dst + off) = u;
#else
    uint32_t w[kLLQuad];
    for (size_t k = 0; k < kLLQuad; ++k) w[k] = static_cast<uint32_t>(pk[k]);
    std::memcpy(dst + off, w, sizeof(w));
#endif
    return;
  }
  const size_t m = ll_quad_size(bytes, q);
  for (size_t k = 0; k < m; ++k) ll_store_payload(dst, bytes, q * kLLQuad + k, pk[k]);
}

}  // namespace nvrar
