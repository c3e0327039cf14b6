// Host side: one kernel launch, as a programmatic dependent of the kernel before it on the stream or not. The
// split and combine launchers say where and why they use programmatic dependent launch; this is only the how.
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "variant.h"

FLASH_MLA_NAMESPACE_BEGIN

// The launch attribute for clusters of `x` CTAs along the grid's x.
inline cudaLaunchAttribute cluster_along_x(int x) {
  cudaLaunchAttribute attribute;
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim.x = x;
  attribute.val.clusterDim.y = 1;
  attribute.val.clusterDim.z = 1;
  return attribute;
}

// With `programmatic`, the grid's CTAs may be scheduled before the previous kernel on `stream` has finished; the
// kernel must then wait in griddepcontrol.wait before it reads anything that kernel writes (without the attribute
// that wait returns at once). A launch error is left for cudaGetLastError (the binding checks it).
// With `cluster_x` > 1 the CTAs are launched as clusters of cluster_x along x (co-scheduled on one GPC; the
// kernel uses no cluster feature).
template <class... KernelArgs, class... Args>
void launch_kernel(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, int smem_bytes, cudaStream_t stream,
                   bool programmatic, int cluster_x, Args&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  cudaLaunchAttribute attribute[2];
  int count = 0;
  if (programmatic) {
    attribute[count].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute[count].val.programmaticStreamSerializationAllowed = 1;
    ++count;
  }
  if (cluster_x > 1) attribute[count++] = cluster_along_x(cluster_x);
  config.attrs = attribute;
  config.numAttrs = count;
  cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

// How many clusters of two CTAs of `kernel` (one CTA per SM) the current device keeps resident at once, for a grid
// like `grid` paired along x; asked once per device (the answer depends on how the device's SMs are grouped, not on
// the call). 0 if the query fails, and that answer is kept too: the launch path asks on every call.
template <class... KernelArgs>
int max_active_pairs(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, int smem_bytes) {
  constexpr int kMaxDevices = 64;
  static int cached[kMaxDevices] = {};    // the answer + 1; 0: not asked yet
  int device = 0;
  cudaGetDevice(&device);
  if (device < kMaxDevices && cached[device] > 0) return cached[device] - 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(2 * ((grid.x + 1) / 2), grid.y, grid.z);
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  cudaLaunchAttribute attribute = cluster_along_x(2);
  config.attrs = &attribute;
  config.numAttrs = 1;
  int clusters = 0;
  if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &config) != cudaSuccess) {
    cudaGetLastError();    // not sticky: clear it, and launch without clusters
    clusters = 0;
  }
  if (device < kMaxDevices) cached[device] = clusters + 1;
  return clusters;
}

FLASH_MLA_NAMESPACE_END  // flash_mla
