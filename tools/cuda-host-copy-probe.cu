/* cuda-host-copy-probe.cu: how fast a 2048-token forward's logits (2048 ×
 * 151,936 float32, 1.24 GB) reach pageable host memory, several ways, each
 * into fresh memory as moe_model_forward's result is (twice over):
 *   A  cudaMemcpyAsync into fresh pageable memory (libmoe before 2026-12-06)
 *   C  the same, the memory advised MADV_HUGEPAGE
 *   B  the pages touched from one thread first, then the copy
 *   D  the memory pinned (cudaHostRegister) for the copy; D' with huge pages
 *   E  staged through two pinned buffers of 8 or 32 MB, one CPU thread
 *   F  the pages touched from 8 threads first, then the copy (libmoe now:
 *      plugins/cuda/moe-cuda-device.c, fault_in)
 *   G  into pinned memory (the link's own speed)
 * Prints the THP settings and the CPU count first. A probe, not a test:
 *
 *   nvcc -O2 -std=c++17 -o /tmp/host-copy-probe tools/cuda-host-copy-probe.cu -cudart static
 *   /tmp/host-copy-probe        (on the GPU machine: carry the binary)
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#include <cuda_runtime.h>
#include <sys/mman.h>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <chrono>
#include <thread>
#include <vector>
static double now () { return std::chrono::duration<double> (std::chrono::steady_clock::now ().time_since_epoch ()).count (); }
static void *fresh (size_t n, bool huge)
{
  void *p = malloc (n);
  if (huge) { uintptr_t a = ((uintptr_t) p + 4095) & ~(uintptr_t) 4095; madvise ((void *) a, n - (a - (uintptr_t) p), MADV_HUGEPAGE); }
  return p;
}
int main ()
{
  const size_t n = (size_t) 2048 * 151936 * 4;
  void *dev; cudaMalloc (&dev, n); cudaMemset (dev, 1, n);
  cudaStream_t s; cudaStreamCreate (&s);
  system ("cat /sys/kernel/mm/transparent_hugepage/enabled /sys/kernel/mm/transparent_hugepage/defrag; nproc");
  for (int rep = 0; rep < 2; rep++) {
  { double t = now (); void *h = fresh (n, false); cudaMemcpyAsync (h, dev, n, cudaMemcpyDeviceToHost, s); cudaStreamSynchronize (s); printf ("A fresh pageable            %7.1f ms\n", (now () - t) * 1e3); free (h); }
  { double t = now (); void *h = fresh (n, true); cudaMemcpyAsync (h, dev, n, cudaMemcpyDeviceToHost, s); cudaStreamSynchronize (s); printf ("C fresh + MADV_HUGEPAGE      %7.1f ms\n", (now () - t) * 1e3); free (h); }
  { void *h = fresh (n, false); double t = now (); memset (h, 0, n); double t1 = now (); cudaMemcpyAsync (h, dev, n, cudaMemcpyDeviceToHost, s); cudaStreamSynchronize (s); printf ("B touch %7.1f ms, then copy %7.1f ms\n", (t1 - t) * 1e3, (now () - t1) * 1e3); free (h); }
  { double t = now (); void *h = fresh (n, false); cudaHostRegister (h, n, cudaHostRegisterDefault); double t1 = now (); cudaMemcpyAsync (h, dev, n, cudaMemcpyDeviceToHost, s); cudaStreamSynchronize (s); double t2 = now (); cudaHostUnregister (h); printf ("D register %7.1f + copy %7.1f + unreg %7.1f ms\n", (t1 - t) * 1e3, (t2 - t1) * 1e3, (now () - t2) * 1e3); free (h); }
  { double t = now (); void *h = fresh (n, true); cudaHostRegister (h, n, cudaHostRegisterDefault); double t1 = now (); cudaMemcpyAsync (h, dev, n, cudaMemcpyDeviceToHost, s); cudaStreamSynchronize (s); double t2 = now (); cudaHostUnregister (h); printf ("D' huge register %7.1f + copy %7.1f + unreg %7.1f ms\n", (t1 - t) * 1e3, (t2 - t1) * 1e3, (now () - t2) * 1e3); free (h); }
  for (int huge = 0; huge < 2; huge++)
  for (size_t chunk : { (size_t) 8 << 20, (size_t) 32 << 20 }) {
    void *stage[2]; cudaHostAlloc (&stage[0], chunk, 0); cudaHostAlloc (&stage[1], chunk, 0);
    cudaEvent_t ev[2]; cudaEventCreateWithFlags (&ev[0], cudaEventDisableTiming); cudaEventCreateWithFlags (&ev[1], cudaEventDisableTiming);
    double t = now (); char *h = (char *) fresh (n, huge);
    size_t nc = (n + chunk - 1) / chunk;
    for (size_t i = 0; i < nc && i < 2; i++) { size_t b = std::min (chunk, n - i * chunk); cudaMemcpyAsync (stage[i % 2], (char *) dev + i * chunk, b, cudaMemcpyDeviceToHost, s); cudaEventRecord (ev[i % 2], s); }
    for (size_t i = 0; i < nc; i++) {
      size_t b = std::min (chunk, n - i * chunk);
      cudaEventSynchronize (ev[i % 2]);
      memcpy (h + i * chunk, stage[i % 2], b);
      if (i + 2 < nc) { size_t b2 = std::min (chunk, n - (i + 2) * chunk); cudaMemcpyAsync (stage[i % 2], (char *) dev + (i + 2) * chunk, b2, cudaMemcpyDeviceToHost, s); cudaEventRecord (ev[i % 2], s); }
    }
    printf ("E staged %2zu MB huge=%d      %7.1f ms\n", chunk >> 20, huge, (now () - t) * 1e3);
    free (h); cudaFreeHost (stage[0]); cudaFreeHost (stage[1]);
  }
  { // F: threads touch (fault) the fresh buffer in parallel while nothing else; then copy
    double t = now (); char *h = (char *) fresh (n, false); int nt = 8; std::vector<std::thread> th;
    for (int i = 0; i < nt; i++) th.emplace_back ([=] { size_t a = n / nt * i, b = i == nt - 1 ? n : n / nt * (i + 1); for (size_t o = a; o < b; o += 4096) h[o] = 0; });
    for (auto &x : th) x.join ();
    double t1 = now (); cudaMemcpyAsync (h, dev, n, cudaMemcpyDeviceToHost, s); cudaStreamSynchronize (s); printf ("F 8-thread touch %7.1f + copy %7.1f ms\n", (t1 - t) * 1e3, (now () - t1) * 1e3); free (h); }
  { void *h; cudaHostAlloc (&h, n, 0); double t = now (); cudaMemcpyAsync (h, dev, n, cudaMemcpyDeviceToHost, s); cudaStreamSynchronize (s); printf ("G pinned dest copy           %7.1f ms\n", (now () - t) * 1e3); cudaFreeHost (h); }
  }
  return 0;
}
