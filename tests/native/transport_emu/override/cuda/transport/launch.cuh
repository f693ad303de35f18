// Host stand-in for csrc/cuda/transport/launch.cuh (same function, same signature), found
// first through -iquote by the emulation build: the kernel must have been loaded (the
// real code loads every kernel at construction), the launch is checked and counted, and
// the grid runs now, in this process, on the execution model's fibers, or is recorded with
// its arguments (by value) when the stream is being captured. pdl is counted; it needs no
// more here: a launch runs after the previous one has completed. Each thread of a kernel
// whose first parameter is the KernelContext hands it to the lane views (emu_lane_view.h).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <tuple>
#include <type_traits>
#include <utility>

#include "emu_lane_view.h"

namespace pa2a::cuda {

template <typename... Params, typename... Args>
void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                   cudaStream_t stream, bool pdl, Args&&... args) {
  emu_rt::require_loaded(reinterpret_cast<const void*>(kernel));
  auto bound = std::make_tuple(std::decay_t<Args>(std::forward<Args>(args))...);
  emu_rt::launch(
      grid, block, smem, stream,
      [kernel, bound] {
        using First = std::decay_t<std::tuple_element_t<0, decltype(bound)>>;
        if constexpr (EmuIsContext<First>::value) emu_lane_view_enter(std::get<0>(bound));
        std::apply(kernel, bound);
      },
      pdl);
}

}  // namespace pa2a::cuda
