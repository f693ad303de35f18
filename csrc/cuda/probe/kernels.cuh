// The calibration probe's kernels: kernel-issued peer stores and loads, the start gate that
// lets flows on several GPUs begin together, and the two latency kernels.
//
// Why kernels and not only cudaMemcpy: on direct-attach boxes the driver may route peer
// loads and stores issued *by kernels* through system memory (~15x slower) while copy-engine
// copies run at full speed (research/field_2026.md section 5), and the transport moves rows
// with kernels. So the probe times exactly what the transport issues: 16-byte vector stores
// from the sender's SMs into peer memory (push) and 16-byte vector loads by the receiver's
// SMs from peer memory (pull).
//
// Invariants:
//  * A flow is (src, dst, bytes); the kernel on the issuing device (src for a store, dst
//    for a load: the pointer that is remote differs, the code does not) copies
//    bytes / 16 vectors spread over its blocks and the bytes % 16 tail with block part 0,
//    never touching dst[bytes..]: the gate checks a guard after every destination.
//  * The start gate: thread 0 of every block spins (relaxed system-scope loads, which are
//    not cached) on a word in mapped host memory that the host sets after every launch of
//    the measurement is queued; it gives up after timeout_ns and records kGateTimeout, so a
//    lost launch becomes an error, never a hang. Each block records the globaltimer after
//    the gate and after its last store; a flow's time is its latest end minus its earliest
//    start, on one GPU's clock (clocks of different GPUs are never compared).
//  * Ping-pong: each side polls only its own flag (local memory) and release-stores into
//    the other's, the protocol's own flag pattern; values carry a per-call base so a flag
//    from an earlier call never matches. Either side gives up after timeout_ns
//    (kPeerTimeout).
//  * Pointer chase: every load's address depends on the previous value, so loads cannot
//    overlap: elapsed / iterations is one round trip.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace pa2a::probe {

struct FlowDesc {
  const unsigned char* src;
  unsigned char* dst;
  uint64_t bytes;
};

enum ProbeError : uint32_t { kOk = 0, kGateTimeout = 1, kPeerTimeout = 2 };

constexpr int kFlowThreads = 512;
constexpr int kChaseStrideWords = 1024;  // 4 KiB between consecutive chase addresses

// times[2 * block] = start ns, times[2 * block + 1] = end ns; go may be null (no gate).
void launch_flows(const FlowDesc* flows, int nflows, int blocks_per_flow, const uint32_t* go,
                  uint64_t timeout_ns, uint64_t* times, uint32_t* error, cudaStream_t stream);

// Blocks until *go != 0 (then the stream's next work starts): the copy engine's start gate.
void launch_gate_wait(const uint32_t* go, uint64_t timeout_ns, uint32_t* error,
                      cudaStream_t stream);

// buf[i] = pattern_byte(seed, i), or its complement (the "not yet written" state).
void launch_fill(unsigned char* buf, uint64_t bytes, uint32_t seed, bool complement,
                 cudaStream_t stream);

// ring[i] = (i + stride) % words: the chase hops `stride` words (a page) at a time, so no
// two consecutive loads share a cache line.
void launch_ring_init(uint32_t* ring, uint32_t words, uint32_t stride, cudaStream_t stream);

// out[0] = ns for `iters` dependent loads from `ring`, out[1] = the last index (kept live).
void launch_chase(const uint32_t* ring, int iters, uint64_t* out, cudaStream_t stream);

// One side of a flag ping-pong (see the header comment); out_ns[0] = ns for all iterations
// on the initiator.
void launch_pingpong(uint64_t* local_flag, uint64_t* remote_flag, uint64_t base, int iters,
                     bool initiator, uint64_t timeout_ns, uint64_t* out_ns, uint32_t* error,
                     cudaStream_t stream);

}  // namespace pa2a::probe
