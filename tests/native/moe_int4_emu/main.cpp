// Runs the INT4 MoE kernel source on the CPU (see emu_cuda.h for the execution model).
//
//   moe_int4_emu DIR
//
// DIR/args.txt    one MoeInt4Args field per line: "name integer", "name @buffer" or
//                 "name @buffer+offset" (a view `offset` bytes into the buffer)
// DIR/device.txt  "num_sms N", "per_sm N" (CTAs per SM, as the occupancy API would say),
//                 "smem_optin BYTES", "l2_bytes BYTES" (default 1 MiB)
// DIR/<buffer>.bin  initial contents of every buffer named in args.txt
// Writes DIR/<buffer>.out.bin for every buffer after the launch sequence. Exit status 0 on
// success, 1 when moe_int4's argument checks reject the arguments (message on stderr),
// 3 when the emulation detects a fault (out-of-bounds cp.async, misalignment, deadlock).
//
// The launch sequence below mirrors moe_int4_run / run_typed / gemm_m in
// csrc/cuda/moe_int4/moe_int4.cu line for line (that host code is only CUDA API calls);
// the argument checks, the GEMM parameters and the grid size come from the same headers.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <type_traits>

#include "cuda/moe_int4/gemm_kernel.cuh"
#include "cuda/moe_int4/schedule.cuh"
#include "cuda/moe_int4/validate.h"
#include "emu_cuda.h"

namespace mi = pa2a::moe_int4;

namespace {

struct Buf {
  void* ptr = nullptr;
  size_t bytes = 0;
};
std::map<std::string, Buf> g_bufs;
std::string g_dir;

Buf& load_buffer(const std::string& name) {
  auto it = g_bufs.find(name);
  if (it != g_bufs.end()) return it->second;
  std::ifstream in(g_dir + "/" + name + ".bin", std::ios::binary | std::ios::ate);
  if (!in) emu::fail("missing buffer file " + name + ".bin");
  Buf b;
  b.bytes = static_cast<size_t>(in.tellg());
  // 256-byte aligned like cudaMalloc; exactly `bytes` long so that the sanitizer's redzone
  // starts right after the buffer.
  if (posix_memalign(&b.ptr, 256, b.bytes ? b.bytes : 1) != 0) emu::fail("posix_memalign");
  in.seekg(0);
  in.read(static_cast<char*>(b.ptr), static_cast<std::streamsize>(b.bytes));
  emu::buffers.push_back(emu::Buffer{static_cast<const unsigned char*>(b.ptr), b.bytes, name});
  return g_bufs[name] = b;
}

template <typename F>
void set_field(F& field, const std::string& value) {
  if (!value.empty() && value[0] == '@') {
    if constexpr (std::is_same_v<F, uintptr_t>) {
      // "@name" or "@name+offset": a view starting `offset` bytes into the buffer
      const size_t plus = value.find('+');
      const std::string name = value.substr(1, plus == std::string::npos ? plus : plus - 1);
      const size_t offset = plus == std::string::npos ? 0 : std::stoull(value.substr(plus + 1));
      field = reinterpret_cast<uintptr_t>(load_buffer(name).ptr) + offset;
    } else {
      emu::fail("a buffer given for a non-pointer field");
    }
  } else {
    field = static_cast<F>(std::stoll(value));
  }
}

mi::MoeInt4Args read_args() {
  mi::MoeInt4Args a;
  std::ifstream in(g_dir + "/args.txt");
  if (!in) emu::fail("missing args.txt");
  std::string name, value;
  while (in >> name >> value) {
    bool known = false;
#define PA2A_FIELD(f)      \
  if (name == #f) {        \
    set_field(a.f, value); \
    known = true;          \
  }
    PA2A_FIELD(dtype)
    PA2A_FIELD(expert_major)
    PA2A_FIELD(x)
    PA2A_FIELD(num_rows)
    PA2A_FIELD(capacity)
    PA2A_FIELD(hidden)
    PA2A_FIELD(num_experts)
    PA2A_FIELD(topk_ids)
    PA2A_FIELD(topk_weights)
    PA2A_FIELD(num_topk)
    PA2A_FIELD(counts)
    PA2A_FIELD(out)
    PA2A_FIELD(acc)
    PA2A_FIELD(w13_qweight)
    PA2A_FIELD(w13_scales)
    PA2A_FIELD(w13_zeros)
    PA2A_FIELD(w13_n_pad)
    PA2A_FIELD(w13_k_pad)
    PA2A_FIELD(w13_group)
    PA2A_FIELD(w13_num_groups)
    PA2A_FIELD(w2_qweight)
    PA2A_FIELD(w2_scales)
    PA2A_FIELD(w2_zeros)
    PA2A_FIELD(w2_n_pad)
    PA2A_FIELD(w2_k_pad)
    PA2A_FIELD(w2_group)
    PA2A_FIELD(w2_num_groups)
    PA2A_FIELD(x_perm)
    PA2A_FIELD(x_perm_buf)
    PA2A_FIELD(h_perm)
    PA2A_FIELD(h_stride)
    PA2A_FIELD(pair_src)
    PA2A_FIELD(pair_w)
    PA2A_FIELD(tiles)
    PA2A_FIELD(status)
    PA2A_FIELD(h)
    PA2A_FIELD(row_pairs)
    PA2A_FIELD(active_rows)
    PA2A_FIELD(split_ws)
    PA2A_FIELD(split_cnt)
    PA2A_FIELD(ws_items)
    PA2A_FIELD(row_cnt)
    PA2A_FIELD(errors)
    PA2A_FIELD(split_k)
    PA2A_FIELD(max_pairs)
    PA2A_FIELD(max_tiles)
    PA2A_FIELD(block_m)
    PA2A_FIELD(device)
    PA2A_FIELD(stream)
#undef PA2A_FIELD
    if (!known) emu::fail("unknown MoeInt4Args field " + name);
  }
  return a;
}

template <typename T, int kBlockM, bool kZeros, bool kGroup32>
void launch_gemm(const mi::GemmParams& p, int num_sms, int per_sm) {
  // launch_gemm in gemm_launch.cuh: the grid from gemm_grid, kThreads threads, the
  // SmemLayout's dynamic shared memory (per_sm stands for the cached occupancy query).
  const int64_t grid = mi::gemm_grid(p, num_sms, per_sm);
  emu::launch(static_cast<unsigned>(grid), mi::kThreads, mi::SmemLayout<kBlockM>::kBytes,
              [&] { mi::moe_int4_gemm_kernel<T, kBlockM, kZeros, kGroup32>(p); });
}

// gemm_m in moe_int4.cu: the instantiation for the operand's variant.
template <typename T, int kBlockM>
void gemm_m(const mi::GemmParams& p, int num_sms, int per_sm) {
  const mi::GemmVariant v = mi::gemm_variant(p, kBlockM);
  if constexpr (kBlockM != 16) {  // no zero-point instantiation (check_args refuses it)
    if (v.group32) {
      launch_gemm<T, kBlockM, false, true>(p, num_sms, per_sm);
    } else {
      launch_gemm<T, kBlockM, false, false>(p, num_sms, per_sm);
    }
  } else if (v.zeros) {
    if (v.group32) {
      launch_gemm<T, kBlockM, true, true>(p, num_sms, per_sm);
    } else {
      launch_gemm<T, kBlockM, true, false>(p, num_sms, per_sm);
    }
  } else if (v.group32) {
    launch_gemm<T, kBlockM, false, true>(p, num_sms, per_sm);
  } else {
    launch_gemm<T, kBlockM, false, false>(p, num_sms, per_sm);
  }
}

template <typename T>
void run_typed(const mi::MoeInt4Args& a, int num_sms, int per_sm, int64_t l2_bytes) {
  if (a.x_perm != 0) {
    const int64_t grid = a.max_tiles < 4L * num_sms ? a.max_tiles : 4L * num_sms;
    emu::launch(static_cast<unsigned>(grid), 256, 0, [&] {
      mi::permute_rows_kernel<T>(reinterpret_cast<const T*>(a.x), static_cast<int64_t>(a.hidden),
                                 reinterpret_cast<const int32_t*>(a.x_perm), a.w13_k_pad,
                                 reinterpret_cast<const int32_t*>(a.tiles),
                                 reinterpret_cast<const int32_t*>(a.status), a.max_tiles,
                                 reinterpret_cast<const int32_t*>(a.pair_src),
                                 reinterpret_cast<T*>(a.x_perm_buf));
    });
  }
  mi::GemmParams g1 = mi::gate_up_params(a);
  g1.prefetch_max_bytes = l2_bytes / 2;
  for (const mi::GemmParams& p : {g1, mi::down_params(a)}) {
    if (a.block_m == 16) {
      gemm_m<T, 16>(p, num_sms, per_sm);
    } else {
      gemm_m<T, 64>(p, num_sms, per_sm);
    }
  }
}

void run(const mi::MoeInt4Args& a, int num_sms, int per_sm, int smem_optin, int64_t l2_bytes) {
  const int64_t pairs = mi::check_args(a);
  const int smem =
      a.block_m == 16 ? mi::SmemLayout<16>::kBytes : mi::SmemLayout<64>::kBytes;  // gemm_smem_bytes
  PA2A_CHECK_ARG(smem <= smem_optin, "moe_int4: block_m=", a.block_m, " needs ", smem,
                 " bytes of shared memory per block; this device allows ", smem_optin);
  if (pairs == 0) return;
  auto* status = reinterpret_cast<int32_t*>(a.status);
  auto* errors = reinterpret_cast<int32_t*>(a.errors);
  if (a.expert_major) {
    emu::launch(1, mi::kScheduleThreads, 0, [&] {
      mi::schedule_expert_major_kernel(
          reinterpret_cast<const int32_t*>(a.counts), a.capacity, a.num_experts, a.block_m,
          reinterpret_cast<int32_t*>(a.pair_src), reinterpret_cast<float*>(a.pair_w),
          reinterpret_cast<int32_t*>(a.tiles), status, a.max_tiles, errors);
    });
  } else {
    emu::launch(1, mi::kScheduleThreads, 0, [&] {
      mi::schedule_rows_kernel(
          reinterpret_cast<const int32_t*>(a.topk_ids),
          reinterpret_cast<const float*>(a.topk_weights), a.num_rows, a.num_topk, a.num_experts,
          a.block_m, reinterpret_cast<int32_t*>(a.pair_src), reinterpret_cast<float*>(a.pair_w),
          reinterpret_cast<int32_t*>(a.tiles), status, a.max_tiles,
          reinterpret_cast<int32_t*>(a.row_pairs), reinterpret_cast<int32_t*>(a.active_rows),
          errors);
    });
  }
  if (a.dtype == 0) {
    run_typed<__nv_bfloat16>(a, num_sms, per_sm, l2_bytes);
  } else {
    run_typed<__half>(a, num_sms, per_sm, l2_bytes);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s DIR\n", argv[0]);
    return 2;
  }
  g_dir = argv[1];
  std::map<std::string, int64_t> dev{
      {"num_sms", 4}, {"per_sm", 1}, {"smem_optin", 101376}, {"l2_bytes", 1 << 20}};
  {
    std::ifstream in(g_dir + "/device.txt");
    std::string k;
    int64_t v;
    while (in >> k >> v) dev[k] = v;
  }
  const mi::MoeInt4Args a = read_args();
  try {
    run(a, static_cast<int>(dev["num_sms"]), static_cast<int>(dev["per_sm"]),
        static_cast<int>(dev["smem_optin"]), dev["l2_bytes"]);
  } catch (const pa2a::Error& e) {
    std::fprintf(stderr, "moe_int4 rejected the arguments: %s\n", e.what());
    return 1;
  }
  for (const auto& [name, b] : g_bufs) {
    std::ofstream out(g_dir + "/" + name + ".out.bin", std::ios::binary);
    out.write(static_cast<const char*>(b.ptr), static_cast<std::streamsize>(b.bytes));
  }
  for (auto& [name, b] : g_bufs) std::free(b.ptr);
  return 0;
}
