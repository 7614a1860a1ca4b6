/* moe-cpu-kernels.c: CPU math shared by the experts backends
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#include "config.h"

#include <math.h>
#include <string.h>
#include <cblas.h>

#include "moe-cpu-kernels.h"
#include "moe-private.h"

#ifdef G_OS_UNIX
#include <sys/mman.h>   /* mincore */
#endif
#include <gmodule.h>

/* Without AVX-512, rows up to this count multiply bf16 weights (and f32
 * [n, k] ones, from 2 rows) in place; above it a half-precision matrix is
 * widened once into scratch so that sgemm can run. With AVX-512 the tiled
 * product (matmul_tiles) takes [n, k] weights at any row count. */
#define DIRECT_MAX_ROWS 8

/* The hot loops are written once as always-inline bodies and compiled
 * twice: for AVX2+FMA and for the baseline, picked at run time. */
#define MOE_BODY static inline __attribute__((always_inline))
#if defined(__x86_64__) && defined(__GNUC__)
# define MOE_HAVE_AVX2_VARIANTS 1
# define MOE_AVX2 __attribute__((target ("avx2,fma")))
#endif

#ifdef MOE_HAVE_AVX2_VARIANTS
/* MOE_CPU_ISA caps the instruction sets of libmoe's own CPU kernels (and
 * of the OpenBLAS kernels it picks): "avx2" (no AVX-512) or "baseline"
 * (no AVX2 either), to compare the forms or test each on one machine;
 * "avx512" or unset: all the CPU runs. Returns 2, 1 or 0. */
static int
cpu_isa_cap (void)
{
  static int cap = -1;
  if (cap < 0)
    {
      const char *isa = g_getenv ("MOE_CPU_ISA");
      if (g_strcmp0 (isa, "baseline") == 0)
        cap = 0;
      else if (g_strcmp0 (isa, "avx2") == 0)
        cap = 1;
      else
        {
          if (isa != NULL && strcmp (isa, "avx512") != 0)
            g_warning ("MOE_CPU_ISA=%s ignored: valid values are avx512, avx2 and baseline", isa);
          cap = 2;
        }
    }
  return cap;
}

static gboolean
cpu_has_avx2_fma (void)
{
  static int has = -1;
  if (has < 0)
    {
      __builtin_cpu_init ();
      has = cpu_isa_cap () >= 1 && __builtin_cpu_supports ("avx2") && __builtin_cpu_supports ("fma");
    }
  return has;
}
# define MOE_DISPATCH(name, ...) \
  (cpu_has_avx2_fma () ? name##_avx2 (__VA_ARGS__) : name##_base (__VA_ARGS__))
# define MOE_VARIANTS(name, params, args)                 \
  MOE_AVX2 static void name##_avx2 params { name##_body args; } \
  static void name##_base params { name##_body args; }
#else
# define MOE_DISPATCH(name, ...) name##_base (__VA_ARGS__)
# define MOE_VARIANTS(name, params, args)                 \
  static void name##_base params { name##_body args; }
#endif

#ifdef MOE_HAVE_AVX2_VARIANTS
/* The in-place few-row products ([n, k] weights) also come in a 16-wide
 * form, for CPUs with AVX-512: on the 2-core Emerald Rapids it took the
 * bf16 Qwen1.5-MoE layer from 121 to 108–111 ms at T = 64 and from 32–33
 * to 29–31 ms at T = 8 (the same minutes, both forms; BENCHMARKS.md) */
# define MOE_AVX512 __attribute__((target ("avx512f,avx512bw,avx512vl,avx2,fma")))
static gboolean
cpu_has_avx512 (void)
{
  static int has = -1;
  if (has < 0)
    {
      __builtin_cpu_init ();
      /* what OpenBLAS's SkylakeX kernels need too (moe_cpu_choose_blas_core) */
      has = cpu_isa_cap () >= 2 && __builtin_cpu_supports ("avx512f") && __builtin_cpu_supports ("avx512bw") &&
            __builtin_cpu_supports ("avx512dq") && __builtin_cpu_supports ("avx512vl") &&
            __builtin_cpu_supports ("avx512cd");
    }
  return has;
}
#endif

/* A function OpenBLAS exports, looked up in the process (libmoe may be
 * linked with another BLAS), or NULL */
static gpointer
openblas_symbol (const char *name)
{
  GModule *self = g_module_open (NULL, G_MODULE_BIND_LAZY);
  gpointer fn = NULL;

  if (self != NULL)
    {
      if (!g_module_symbol (self, name, &fn))
        fn = NULL;
      g_module_close (self);   /* the program's own handle: nothing is unloaded */
    }
  return fn;
}

/* OpenBLAS built for several CPUs (DYNAMIC_ARCH, as distributions ship
 * it) picks its kernels by the CPU's model number, and a release older
 * than the CPU takes its generic x86-64 ones ("Prescott": SSE3) — Debian
 * 12's 0.3.21 on Intel's Emerald Rapids, where sgemm then ran 5× slower
 * than with the AVX-512 kernels the CPU runs (BENCHMARKS.md,
 * thirty-seventh session). Where that happened and OPENBLAS_CORETYPE does
 * not choose already, the kernels are picked by what the CPU can run, as
 * that variable would pick them: OpenBLAS's dispatch is made again with
 * it set. This runs as libmoe is loaded, before any of its matmuls, and
 * while a program is mostly still one thread (the environment is not
 * safe to change beside other threads); a process that runs OpenBLAS
 * from another thread at that moment should set OPENBLAS_CORETYPE itself. */
#if defined(MOE_HAVE_AVX2_VARIANTS) && defined(G_OS_UNIX)
__attribute__ ((constructor)) static void
moe_cpu_choose_blas_core (void)
{
  char *(*corename) (void) = openblas_symbol ("openblas_get_corename");
  void (*dispatch_quit) (void) = openblas_symbol ("gotoblas_dynamic_quit");
  void (*dispatch_init) (void) = openblas_symbol ("gotoblas_dynamic_init");
  const char *core = cpu_has_avx512 () ? "SkylakeX" : cpu_has_avx2_fma () ? "Haswell" : NULL;

  if (corename != NULL && dispatch_quit != NULL && dispatch_init != NULL && core != NULL &&
      g_getenv ("OPENBLAS_CORETYPE") == NULL && g_strcmp0 (corename (), "Prescott") == 0)
    {
      g_setenv ("OPENBLAS_CORETYPE", core, FALSE);
      dispatch_quit ();
      dispatch_init ();
    }
}
#endif

typedef float   v8f   __attribute__ ((vector_size (32)));
typedef guint16 v8u16 __attribute__ ((vector_size (16)));
typedef guint32 v8u32 __attribute__ ((vector_size (32)));

/* Eight bf16 values widened to float: a 16-bit shift of each. */
MOE_BODY v8f
load8_bf16 (const guint16 *p)
{
  v8u16 h;
  v8u32 u;
  v8f f;

  memcpy (&h, p, sizeof h);
  /* zero-extended then shifted: one vpmovzxwd from memory and a shift with
   * AVX2 (GCC split __builtin_convertvector's form in two halves) */
  u = (v8u32) { h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7] } << 16;
  memcpy (&f, &u, sizeof f);
  return f;
}

MOE_BODY v8f
load8_f32 (const float *p)
{
  v8f f;
  memcpy (&f, p, sizeof f);
  return f;
}

MOE_BODY float
hsum8 (v8f v)
{
  return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

gboolean
moe_cpu_activation_from_name (const char       *name,
                              MoeCpuActivation *act)
{
  static const struct { const char *name; MoeCpuActivation act; } names[] = {
    { "silu", MOE_CPU_ACT_SILU },
    { "swish", MOE_CPU_ACT_SILU },
    { "gelu", MOE_CPU_ACT_GELU },
    { "gelu_pytorch_tanh", MOE_CPU_ACT_GELU_TANH },
    { "gelu_new", MOE_CPU_ACT_GELU_TANH },
    { "relu", MOE_CPU_ACT_RELU },
  };

  for (guint i = 0; name != NULL && i < G_N_ELEMENTS (names); i++)
    if (g_str_equal (name, names[i].name))
      {
        *act = names[i].act;
        return TRUE;
      }
  return FALSE;
}

float
moe_f16_to_f32 (guint16 h)
{
  guint32 sign = (guint32) (h & 0x8000) << 16;
  guint32 exp = (h >> 10) & 0x1f;
  guint32 man = h & 0x3ff;
  union { guint32 u; float f; } c;

  if (exp == 0x1f)
    c.u = sign | 0x7f800000 | (man << 13);
  else if (exp != 0)
    c.u = sign | ((exp + 112) << 23) | (man << 13);
  else if (man == 0)
    c.u = sign;
  else
    {
      /* subnormal: value = man * 2^-24 */
      c.f = (float) man * 5.9604644775390625e-08f;
      c.u |= sign;
    }
  return c.f;
}

guint16
moe_f32_to_f16 (float f)
{
  union { float f; guint32 u; } c = { .f = f };
  guint32 sign = (c.u >> 16) & 0x8000;
  guint32 abs = c.u & 0x7fffffff;

  if (abs > 0x7f800000)
    return (guint16) (sign | 0x7e00);
  if (abs >= 0x477ff000)                      /* rounds to >= 65520: inf */
    return (guint16) (sign | 0x7c00);
  if (abs < 0x38800000)                       /* below the smallest normal */
    {
      /* scale into the subnormal range and let the FPU round to nearest even */
      union { float f; guint32 u; } a = { .u = abs };
      float v = a.f * 16777216.0f;            /* 2^24 */
      return (guint16) (sign | (guint32) nearbyintf (v));
    }
  guint32 r = abs + 0xfff + ((abs >> 13) & 1) - (112u << 23);
  return (guint16) (sign | (r >> 13));
}

/* inlined in this file's loops over every element (a call each through
 * the PLT took ~5% of a bf16 experts layer) */
static inline float
round_to (float    v,
          MoeDType dtype)
{
  switch (dtype)
    {
    case MOE_DTYPE_BF16:
      return moe_bf16_to_f32 (moe_f32_to_bf16 (v));
    case MOE_DTYPE_F16:
      return moe_f16_to_f32 (moe_f32_to_f16 (v));
    default:
      return v;
    }
}

float
moe_cpu_round_to (float    v,
                  MoeDType dtype)
{
  return round_to (v, dtype);
}

static inline float
load_f32 (MoeDType      dtype,
          gconstpointer data,
          gsize         i)
{
  switch (dtype)
    {
    case MOE_DTYPE_F32:  return ((const float *) data)[i];
    case MOE_DTYPE_BF16: return moe_bf16_to_f32 (((const guint16 *) data)[i]);
    case MOE_DTYPE_F16:  return moe_f16_to_f32 (((const guint16 *) data)[i]);
    case MOE_DTYPE_F64:  return (float) ((const double *) data)[i];
    default: g_assert_not_reached ();
    }
}

MOE_BODY void
bf16_to_f32_array_body (const guint16 *src, float *dst, gsize n)
{
  gsize i = 0;

  for (; i + 8 <= n; i += 8)
    {
      v8f f = load8_bf16 (src + i);
      memcpy (dst + i, &f, sizeof f);
    }
  for (; i < n; i++)
    dst[i] = moe_bf16_to_f32 (src[i]);
}
MOE_VARIANTS (bf16_to_f32_array, (const guint16 *src, float *dst, gsize n), (src, dst, n))

void
moe_cpu_convert (MoeDType      src_dtype,
                 gconstpointer src,
                 MoeDType      dst_dtype,
                 gpointer      dst,
                 gsize         n)
{
  if (src_dtype == dst_dtype)
    {
      memcpy (dst, src, n * moe_dtype_get_size (src_dtype));
      return;
    }
  if (src_dtype == MOE_DTYPE_BF16 && dst_dtype == MOE_DTYPE_F32)
    {
      MOE_DISPATCH (bf16_to_f32_array, src, dst, n);
      return;
    }
  for (gsize i = 0; i < n; i++)
    {
      float v = load_f32 (src_dtype, src, i);
      switch (dst_dtype)
        {
        case MOE_DTYPE_F32:  ((float *) dst)[i] = v; break;
        case MOE_DTYPE_BF16: ((guint16 *) dst)[i] = moe_f32_to_bf16 (v); break;
        case MOE_DTYPE_F16:  ((guint16 *) dst)[i] = moe_f32_to_f16 (v); break;
        case MOE_DTYPE_F64:
          /* widen exactly from the source, not through float */
          ((double *) dst)[i] = src_dtype == MOE_DTYPE_F64 ? ((const double *) src)[i] : (double) v;
          break;
        default: g_assert_not_reached ();
        }
    }
}

void
moe_cpu_gather_rows (MoeDType      dtype,
                     gconstpointer src,
                     gsize         width,
                     const gint64 *rows,
                     gsize         n_rows,
                     float        *dst)
{
  gsize elt = moe_dtype_get_size (dtype);

  for (gsize r = 0; r < n_rows; r++)
    moe_cpu_convert (dtype, (const guint8 *) src + (gsize) rows[r] * width * elt,
                     MOE_DTYPE_F32, dst + r * width, width);
}

/* what moe_cpu_fault_in writes one byte of (the smallest page here) */
#define FAULT_PAGE ((gsize) 4096)

typedef struct {
  volatile char *start;
  gsize          size;
} FaultSlice;

static gpointer
fault_in_slice (gpointer data)
{
  FaultSlice *s = data;

  for (gsize off = 0; off < s->size; off += FAULT_PAGE)
    s->start[off] = 0;
  /* the last page, where the slice does not start at a page's start */
  if (s->size > 0)
    s->start[s->size - 1] = 0;
  return NULL;
}

/* Whether the first whole page of @mem is in memory already: a buffer
 * used before (generate's logits, filled again every step), whose pages
 * need no faulting in; fresh memory's are not. (Starting the threads for
 * nothing cost ~120 µs a call for 9 MiB on the 2-core machine.) */
static gboolean
first_page_resident (gpointer mem)
{
#ifdef G_OS_UNIX
  unsigned char in_core = 0;
  gpointer page = (gpointer) (((guintptr) mem + FAULT_PAGE - 1) & ~(guintptr) (FAULT_PAGE - 1));

  return mincore (page, FAULT_PAGE, (void *) &in_core) == 0 && (in_core & 1);
#else
  return FALSE;
#endif
}

/* (Fresh memory's first-touch faults, taken one at a time, were most of
 * the time of filling it on the lent H100 machine: 0.58-0.72 s for 1.24 GB
 * of logits from one thread, 94-102 ms from 8 (BENCHMARKS.md, twenty-fourth
 * session); on this project's 2-core machine a checkpoint's experts copied
 * into a fresh buffer ran 0.5-0.7 GB/s from one thread.) */
void
moe_cpu_fault_in (gpointer mem,
                  gsize    size)
{
  guint n;
  gsize per;
  FaultSlice slices[8];
  GThread *threads[8] = { NULL, };

  if (size < MOE_CPU_FAULT_IN_MIN || first_page_resident (mem))
    return;
  n = CLAMP (g_get_num_processors (), 1, 8);
  per = ((size + n - 1) / n + FAULT_PAGE - 1) / FAULT_PAGE * FAULT_PAGE;
  for (guint i = 0; i < n; i++)
    {
      gsize off = MIN (i * per, size);
      slices[i] = (FaultSlice) { (volatile char *) mem + off, MIN (per, size - off) };
      /* slice 0 on this thread; any other whose thread could not start too */
      if (i > 0)
        threads[i] = g_thread_try_new ("moe-fault-in", fault_in_slice, &slices[i], NULL);
    }
  fault_in_slice (&slices[0]);
  for (guint i = 1; i < n; i++)
    if (threads[i] != NULL)
      g_thread_join (threads[i]);
    else
      fault_in_slice (&slices[i]);
}

/* Per-thread scratch for widening a half-precision expert matrix. */
typedef struct { float *data; gsize size; } Scratch;

static void
scratch_free (gpointer p)
{
  Scratch *s = p;
  g_free (s->data);
  g_free (s);
}

static GPrivate scratch_key = G_PRIVATE_INIT (scratch_free);

static float *
get_scratch (gsize n)
{
  Scratch *s = g_private_get (&scratch_key);
  if (s == NULL)
    {
      s = g_new0 (Scratch, 1);
      g_private_set (&scratch_key, s);
    }
  if (s->size < n)
    {
      g_free (s->data);
      s->data = g_new (float, n);
      s->size = n;
    }
  return s->data;
}

/* ---- work split over the cores ------------------------------------------
 *
 * The matmul work libmoe does itself (weights read in place: with
 * AVX-512 in tiles, without it for few rows; half-precision weights
 * widened before sgemm) is split over as
 * many threads as OpenBLAS runs its own with (OPENBLAS_NUM_THREADS; the
 * processors where the BLAS is not OpenBLAS), so that "the same cores" is
 * one setting. The workers block between jobs rather than spin: on a
 * loaded machine spinning workers made such calls several times slower. */

#define MAX_THREADS 64

typedef void (*RangeFunc) (gpointer data, gsize begin, gsize end);

typedef struct {
  RangeFunc fn;
  gpointer  data;
  gsize     n, grain;
  guint     parts;
  guint     pending;   /* parts not done yet */
  GMutex    lock;
  GCond     done;
} Job;

typedef struct {
  Job   *job;
  guint  part;
} JobPart;

static GThreadPool *workers;
static guint n_threads = 1;

static void
job_run_part (Job   *job,
              guint  part)
{
  /* parts of whole grains, as even as the grains allow */
  gsize grains = (job->n + job->grain - 1) / job->grain;
  gsize begin = MIN (job->n, grains * part / job->parts * job->grain);
  gsize end = MIN (job->n, grains * (part + 1) / job->parts * job->grain);

  if (begin < end)
    job->fn (job->data, begin, end);
  g_mutex_lock (&job->lock);
  if (--job->pending == 0)
    g_cond_signal (&job->done);
  g_mutex_unlock (&job->lock);
}

static void
worker_run (gpointer task,
            gpointer user_data)
{
  JobPart *p = task;
  job_run_part (p->job, p->part);
}

static void
workers_init (void)
{
  static gsize once = 0;

  if (g_once_init_enter (&once))
    {
      int (*blas_threads) (void) = openblas_symbol ("openblas_get_num_threads");
      guint n = blas_threads != NULL && blas_threads () > 0 ? (guint) blas_threads () : g_get_num_processors ();

      n_threads = CLAMP (n, 1, MAX_THREADS);
      if (n_threads > 1)
        workers = g_thread_pool_new (worker_run, NULL, (int) n_threads - 1, FALSE, NULL);
      if (workers == NULL)
        n_threads = 1;
      g_once_init_leave (&once, 1);
    }
}

/* Work of fewer weights than this is not worth the threads' hand-over
 * (~10-20 µs) */
#define PARALLEL_MIN_WEIGHTS ((gsize) 1 << 18)

/* fn (data, begin, end) over [0, n) in parts of whole @grain-sized steps,
 * one a thread, this thread taking the first, where the call reads
 * @weights weights or more; returns when all are done */
static void
parallel_for (gsize     n,
              gsize     grain,
              gsize     weights,
              RangeFunc fn,
              gpointer  data)
{
  Job job = { fn, data, n, grain, 1, 0, };
  JobPart parts[MAX_THREADS];

  if (weights < PARALLEL_MIN_WEIGHTS)
    {
      fn (data, 0, n);
      return;
    }
  workers_init ();
  job.parts = (guint) MIN ((gsize) n_threads, (n + grain - 1) / MAX (grain, 1));
  if (job.parts <= 1)
    {
      fn (data, 0, n);
      return;
    }
  job.pending = job.parts;
  g_mutex_init (&job.lock);
  g_cond_init (&job.done);
  for (guint i = 1; i < job.parts; i++)
    {
      parts[i] = (JobPart) { &job, i };
      if (!g_thread_pool_push (workers, &parts[i], NULL))
        job_run_part (&job, i);
    }
  job_run_part (&job, 0);
  g_mutex_lock (&job.lock);
  while (job.pending > 0)
    g_cond_wait (&job.done, &job.lock);
  g_mutex_unlock (&job.lock);
  g_mutex_clear (&job.lock);
  g_cond_clear (&job.done);
}

/* Eight weights from @w (bf16 or f32, @bf16 a constant where inlined) at
 * element @i, as floats; and one */
MOE_BODY v8f
load8_w (gconstpointer w, gsize i, gboolean bf16)
{
  return bf16 ? load8_bf16 ((const guint16 *) w + i) : load8_f32 ((const float *) w + i);
}

MOE_BODY float
load1_w (gconstpointer w, gsize i, gboolean bf16)
{
  return bf16 ? moe_bf16_to_f32 (((const guint16 *) w)[i]) : ((const float *) w)[i];
}

#ifdef MOE_HAVE_AVX2_VARIANTS
typedef float   v16f   __attribute__ ((vector_size (64)));
typedef guint32 v16u32 __attribute__ ((vector_size (64)));

MOE_BODY v16f
load16_f32 (const float *p)
{
  v16f f;
  memcpy (&f, p, sizeof f);
  return f;
}

MOE_BODY float
hsum16 (v16f v)
{
  v8f lo, hi;
  memcpy (&lo, &v, sizeof lo);
  memcpy (&hi, (const char *) &v + sizeof lo, sizeof hi);
  return hsum8 (lo + hi);
}
#endif

/* y[m, n] = x[m, k] · W[n, k]ᵀ with W (bf16 or f32) read in place: each
 * weight row is read once and used for all m rows (where sgemm would copy
 * the whole matrix into its panels for a few rows). Called with a constant
 * m; the loops over q and r unrolled whole, so that acc is registers (left
 * as loops, GCC kept acc on the stack: a load and a store around every
 * FMA, ~5 flops a cycle); two weight rows at a time for m ≤ 4 to keep more
 * independent sums in flight. */
MOE_BODY void
matmul_nt_rows (const float *x, gsize m, gconstpointer w, gboolean bf16, gsize n, gsize k, float *y, gsize ldy)
{
  gsize k8 = k & ~(gsize) 7;
  gsize step = m <= 4 ? 2 : 1;
  gsize j = 0;

  for (; j + step <= n; j += step)
    {
      v8f acc[2][DIRECT_MAX_ROWS];

      _Pragma ("GCC unroll 2") for (gsize q = 0; q < step; q++)
        _Pragma ("GCC unroll 8") for (gsize r = 0; r < m; r++)
          acc[q][r] = (v8f) { 0, };
      for (gsize i = 0; i < k8; i += 8)
        _Pragma ("GCC unroll 2") for (gsize q = 0; q < step; q++)
          {
            v8f wv = load8_w (w, (j + q) * k + i, bf16);
            _Pragma ("GCC unroll 8") for (gsize r = 0; r < m; r++)
              acc[q][r] += load8_f32 (x + r * k + i) * wv;
          }
      _Pragma ("GCC unroll 2") for (gsize q = 0; q < step; q++)
        _Pragma ("GCC unroll 8") for (gsize r = 0; r < m; r++)
          {
            float sum = hsum8 (acc[q][r]);
            for (gsize i = k8; i < k; i++)
              sum += x[r * k + i] * load1_w (w, (j + q) * k + i, bf16);
            y[r * ldy + j + q] = sum;
          }
    }
  for (; j < n; j++)
    for (gsize r = 0; r < m; r++)
      {
        float sum = 0;
        for (gsize i = 0; i < k; i++)
          sum += x[r * k + i] * load1_w (w, j * k + i, bf16);
        y[r * ldy + j] = sum;
      }
}

/* Outputs [n0, n1) of y (rows @ldy apart), with m a constant in each
 * call: a part of the outputs is a part of W's rows */
MOE_BODY void
matmul_nt_part (const float *x, gsize m, gconstpointer w, gboolean bf16, gsize k, float *y, gsize ldy, gsize n0,
                gsize n1)
{
  w = (const guint8 *) w + n0 * k * (bf16 ? 2 : 4), y += n0;
  switch (m)
    {
    case 1: matmul_nt_rows (x, 1, w, bf16, n1 - n0, k, y, ldy); break;
    case 2: matmul_nt_rows (x, 2, w, bf16, n1 - n0, k, y, ldy); break;
    case 3: matmul_nt_rows (x, 3, w, bf16, n1 - n0, k, y, ldy); break;
    case 4: matmul_nt_rows (x, 4, w, bf16, n1 - n0, k, y, ldy); break;
    case 5: matmul_nt_rows (x, 5, w, bf16, n1 - n0, k, y, ldy); break;
    case 6: matmul_nt_rows (x, 6, w, bf16, n1 - n0, k, y, ldy); break;
    case 7: matmul_nt_rows (x, 7, w, bf16, n1 - n0, k, y, ldy); break;
    default:
      g_assert (m == DIRECT_MAX_ROWS);
      matmul_nt_rows (x, DIRECT_MAX_ROWS, w, bf16, n1 - n0, k, y, ldy);
    }
}

#ifdef MOE_HAVE_AVX2_VARIANTS
/* ---- the tiled product: rows × weight rows in registers -----------------
 *
 * y[m, n] = x[m, k] · W[n, k]ᵀ for any m, bf16 or f32 W read in place, in
 * tiles whose sums stay in registers (moe-cpu-tiles.inc), one form for
 * AVX-512 and one for AVX2. Where sgemm needs bf16 weights widened into an
 * f32 copy first, this reads them once as they are: on the 2-core Emerald
 * Rapids one 34 × 2816 × 2048 product took 4.3 ms against 9.4 for
 * widening + sgemm (one thread), and a bf16 Qwen1.5-MoE layer at T = 512
 * 0.32 against 0.67 s (BENCHMARKS.md). */

/* x's rows are taken this many at a time (512 KiB of packed inputs at k =
 * 2048: L2), each block passing over the part of W; so many rows are
 * not read from L3 again for every tile of W */
#define TILE_BLOCK_ROWS 64
/* and W's inputs this many bytes of a tile at a time (AVX-512: 2048 bf16
 * inputs, 1024 f32), a tile's weights staying in L1 while the rows pass:
 * f32 tiles of whole 2048-input rows (48 KiB) did not */
#define TILE_BLOCK_BYTES (24 * 1024)
/* f32 weights of fewer inputs go to sgemm (moe_cpu_matmul) */
#define TILE_F32_MIN_K 512

/* Rows of x as the tiles read them: @kp (k rounded up to whole chunks of
 * @chunk inputs) apart, zero past k; with bf16 weights each chunk holds
 * its even inputs then its odd ones, the order load_w_half splits a
 * vector of bf16 weights in (f32 weights: the inputs in order) */
static void
pack_rows (const float *x,
           gsize        m,
           gsize        k,
           gboolean     bf16,
           gsize        chunk,
           float       *xp)
{
  gsize kp = (k + chunk - 1) / chunk * chunk;

  for (gsize r = 0; r < m; r++)
    for (gsize c = 0; c < kp; c += chunk)
      for (gsize l = 0; l < chunk / 2; l++)
        {
          gsize even = bf16 ? c + 2 * l : c + l;
          gsize odd = bf16 ? c + 2 * l + 1 : c + chunk / 2 + l;

          xp[r * kp + c + l] = even < k ? x[r * k + even] : 0.0f;
          xp[r * kp + c + chunk / 2 + l] = odd < k ? x[r * k + odd] : 0.0f;
        }
}

/* AVX-512: 4 × 6 tiles (24 sums, 6 weight vectors and an input: the 32
 * registers) */
#define TILE_V      v16f
#define TILE_VU     v16u32
#define TILE_WIDTH  16
#define TILE_LOAD   load16_f32
#define TILE_HSUM   hsum16
#define TILE_ROWS   4
#define TILE_COLS   6
#define TILE_TARGET MOE_AVX512
#define TILE_FN(name) name##_avx512
#include "moe-cpu-tiles.inc"

/* AVX2: 3 × 3 tiles (16 registers; against 4 × 2, 2 × 4, 2 × 5 and 4 × 3
 * on the Emerald Rapids, AVX2 kernels only: the fastest or level at T = 1
 * to 512, bf16 and f32) */
#define TILE_V      v8f
#define TILE_VU     v8u32
#define TILE_WIDTH  8
#define TILE_LOAD   load8_f32
#define TILE_HSUM   hsum8
#define TILE_ROWS   3
#define TILE_COLS   3
#define TILE_TARGET MOE_AVX2
#define TILE_FN(name) name##_avx2
#include "moe-cpu-tiles.inc"
#endif

/* y[m, n] = x[m, k] · W[k, n] with W read in place: outputs [n0, n1), a
 * part of each of W's rows (@ldw = n apart; y's rows too). */
MOE_BODY void
matmul_nn_part (const float *x, gsize m, gconstpointer w, gboolean bf16, gsize k, float *y, gsize ldw, gsize n0,
                gsize n1)
{
  gsize n = n1 - n0, n8 = n & ~(gsize) 7;

  y += n0;
  for (gsize r = 0; r < m; r++)
    memset (y + r * ldw, 0, n * sizeof (float));
  for (gsize i = 0; i < k; i++)
    {
      gsize row = i * ldw + n0;
      for (gsize j = 0; j < n8; j += 8)
        {
          v8f wv = load8_w (w, row + j, bf16);
          for (gsize r = 0; r < m; r++)
            {
              v8f yv = load8_f32 (y + r * ldw + j) + x[r * k + i] * wv;
              memcpy (y + r * ldw + j, &yv, sizeof yv);
            }
        }
      for (gsize j = n8; j < n; j++)
        for (gsize r = 0; r < m; r++)
          y[r * ldw + j] += x[r * k + i] * load1_w (w, row + j, bf16);
    }
}

#define MATMUL_PART_PARAMS (const float *x, gsize m, gconstpointer w, gsize k, float *y, gsize ld, gsize n0, gsize n1)
MOE_BODY void matmul_bf16_nt_body MATMUL_PART_PARAMS { matmul_nt_part (x, m, w, TRUE, k, y, ld, n0, n1); }
MOE_BODY void matmul_f32_nt_body MATMUL_PART_PARAMS { matmul_nt_part (x, m, w, FALSE, k, y, ld, n0, n1); }
MOE_BODY void matmul_bf16_nn_body MATMUL_PART_PARAMS { matmul_nn_part (x, m, w, TRUE, k, y, ld, n0, n1); }
MOE_VARIANTS (matmul_bf16_nt, MATMUL_PART_PARAMS, (x, m, w, k, y, ld, n0, n1))
MOE_VARIANTS (matmul_f32_nt, MATMUL_PART_PARAMS, (x, m, w, k, y, ld, n0, n1))
MOE_VARIANTS (matmul_bf16_nn, MATMUL_PART_PARAMS, (x, m, w, k, y, ld, n0, n1))

/* One few-row product with weights read in place, split over the threads
 * by outputs */
typedef struct {
  const float        *x;
  gsize               m;
  const MoeCpuMatrix *w;
  float              *y;
} DirectMatmul;

static void
direct_matmul_part (gpointer data,
                    gsize    n0,
                    gsize    n1)
{
  const DirectMatmul *d = data;
  const MoeCpuMatrix *w = d->w;

  g_assert (w->dtype == MOE_DTYPE_BF16 || !w->transposed);   /* moe_cpu_matmul keeps f32 [k, n] on sgemm */
  if (w->dtype == MOE_DTYPE_F32)
    MOE_DISPATCH (matmul_f32_nt, d->x, d->m, w->data, w->k, d->y, w->n, n0, n1);
  else if (w->transposed)
    MOE_DISPATCH (matmul_bf16_nn, d->x, d->m, w->data, w->k, d->y, w->n, n0, n1);
  else
    MOE_DISPATCH (matmul_bf16_nt, d->x, d->m, w->data, w->k, d->y, w->n, n0, n1);
}

#ifdef MOE_HAVE_AVX2_VARIANTS
/* The tiled product of packed rows (@tiles: the AVX-512 or AVX2 form,
 * chosen once a call), split over the threads by outputs */
typedef struct {
  const float        *xp;
  gsize               m;
  const MoeCpuMatrix *w;
  float              *y;
  void              (*tiles) (const float *xp, gsize m, gconstpointer w, gboolean bf16, gsize k, float *y,
                              gsize ldy, gsize n0, gsize n1);
} TiledMatmul;

static void
tiled_matmul_part (gpointer data,
                   gsize    n0,
                   gsize    n1)
{
  const TiledMatmul *t = data;

  t->tiles (t->xp, t->m, t->w->data, t->w->dtype == MOE_DTYPE_BF16, t->w->k, t->y, t->w->n, n0, n1);
}
#endif

/* moe_cpu_convert of n values, split over the threads */
typedef struct {
  MoeDType      src_dtype, dst_dtype;
  gconstpointer src;
  gpointer      dst;
} Convert;

static void
convert_part (gpointer data,
              gsize    begin,
              gsize    end)
{
  const Convert *c = data;

  moe_cpu_convert (c->src_dtype, (const guint8 *) c->src + begin * moe_dtype_get_size (c->src_dtype),
                   c->dst_dtype, (guint8 *) c->dst + begin * moe_dtype_get_size (c->dst_dtype), end - begin);
}

void
moe_cpu_matmul (const float        *x,
                gsize               m,
                const MoeCpuMatrix *w,
                float              *y)
{
  const float *wf;

  if (m == 0)
    return;

  if (moe_cpu_matrix_is_quantized (w))
    {
      _moe_cpu_matmul_quantized (x, m, w, y);
      return;
    }

#ifdef MOE_HAVE_AVX2_VARIANTS
  /* AVX-512 or AVX2: [n, k] weights in place by tiles, any rows but one
   * f32 row, which OpenBLAS's sgemv streams faster (f32 Qwen1.5-MoE layer
   * at T = 1: 2.8–3.4 against 3.5–4.3 ms, runs alternating), and f32 rows
   * of fewer than TILE_F32_MIN_K inputs, where a tile's horizontal sums
   * cost about as much as its products and sgemm has nothing to widen (the
   * H = 128 fixture's f32 layer: 2.3 against 4.4–5.6 ms) */
  if ((cpu_has_avx512 () || cpu_has_avx2_fma ()) && !w->transposed &&
      (w->dtype == MOE_DTYPE_BF16 || (w->dtype == MOE_DTYPE_F32 && m >= 2 && w->k >= TILE_F32_MIN_K)))
    {
      gboolean wide = cpu_has_avx512 ();
      gsize chunk = wide ? tile_chunk_avx512 : tile_chunk_avx2;
      gsize kp = (w->k + chunk - 1) / chunk * chunk;
      float *xp = get_scratch (m * kp);
      TiledMatmul t = { xp, m, w, y, wide ? matmul_tiles_avx512 : matmul_tiles_avx2 };

      pack_rows (x, m, w->k, w->dtype == MOE_DTYPE_BF16, chunk, xp);
      /* parts of 48 outputs: whole tiles, and whole cache lines of y's rows */
      parallel_for (w->n, 48, w->n * w->k, tiled_matmul_part, &t);
      return;
    }
#endif

  /* few rows: bf16 weights in place (not widened), and f32 [n, k] ones
   * from 2 rows. One f32 row stays with sgemv: OpenBLAS's AVX-512 form
   * streamed the weights ~15% faster than this AVX2 one (on an Emerald
   * Rapids, f32 T = 1 2.7–3.2 against 3.6 ms). [k, n] f32 weights, whose
   * in-place form adds into all of y's rows each input, stay with sgemm. */
  if ((w->dtype == MOE_DTYPE_BF16 || (w->dtype == MOE_DTYPE_F32 && !w->transposed && m >= 2)) &&
      m <= DIRECT_MAX_ROWS)
    {
      DirectMatmul d = { x, m, w, y };
      /* parts of 16 outputs: whole cache lines of y's rows */
      parallel_for (w->n, 16, w->n * w->k, direct_matmul_part, &d);
      return;
    }

  if (w->dtype == MOE_DTYPE_F32)
    wf = w->data;
  else
    {
      float *s = get_scratch (w->n * w->k);
      Convert c = { w->dtype, MOE_DTYPE_F32, w->data, s };
      parallel_for (w->n * w->k, 4096, w->n * w->k, convert_part, &c);
      wf = s;
    }

  if (m == 1)
    {
      if (w->transposed)
        cblas_sgemv (CblasRowMajor, CblasTrans, w->k, w->n, 1.0f, wf, w->n, x, 1, 0.0f, y, 1);
      else
        cblas_sgemv (CblasRowMajor, CblasNoTrans, w->n, w->k, 1.0f, wf, w->k, x, 1, 0.0f, y, 1);
      return;
    }

  cblas_sgemm (CblasRowMajor, CblasNoTrans, w->transposed ? CblasNoTrans : CblasTrans,
               m, w->n, w->k, 1.0f, x, w->k,
               wf, w->transposed ? w->n : w->k,
               0.0f, y, w->n);
}

/**
 * moe_cpu_round_array: (skip)
 * @x: values
 * @n: how many
 * @dtype: F32 (nothing to do), BF16 or F16
 *
 * Rounds each value to @dtype, keeping it as float32.
 */
void
moe_cpu_round_array (float    *x,
                     gsize     n,
                     MoeDType  dtype)
{
  if (dtype != MOE_DTYPE_BF16 && dtype != MOE_DTYPE_F16)
    return;
  for (gsize i = 0; i < n; i++)
    x[i] = round_to (x[i], dtype);
}

void
moe_cpu_add_bias (float         *rows,
                  gsize          m,
                  gsize          n,
                  MoeDType       dtype,
                  gconstpointer  bias)
{
  for (gsize r = 0; r < m; r++)
    for (gsize j = 0; j < n; j++)
      rows[r * n + j] += load_f32 (dtype, bias, j);
}

static inline float
activate (MoeCpuActivation act, float v)
{
  switch (act)
    {
    case MOE_CPU_ACT_SILU:
      return v / (1.0f + expf (-v));
    case MOE_CPU_ACT_GELU:
      return 0.5f * v * (1.0f + erff (v * (float) M_SQRT1_2));
    case MOE_CPU_ACT_GELU_TANH:
      {
        const float c = 0.7978845608028654f;   /* sqrt(2/pi) */
        return 0.5f * v * (1.0f + tanhf (c * (v + 0.044715f * v * v * v)));
      }
    case MOE_CPU_ACT_RELU:
      return v > 0.0f ? v : 0.0f;
    default:
      g_assert_not_reached ();
    }
}

void
moe_cpu_apply_gate (const float      *up,
                    gsize             m,
                    gsize             inter,
                    const MoeCpuGate *gate,
                    float            *out)
{
  MoeDType d = gate->round;

#define R(v) round_to ((v), d)
  for (gsize r = 0; r < m; r++)
    {
      float *o = out + r * inter;

      if (!gate->has_gate)
        {
          const float *u = up + r * inter;
          for (gsize j = 0; j < inter; j++)
            o[j] = R (activate (gate->activation, u[j]));
        }
      else if (gate->interleaved)
        {
          /* GPT-OSS: even columns gate, odd columns up; each op rounded as torch does */
          const float *gu = up + r * 2 * inter;
          for (gsize j = 0; j < inter; j++)
            {
              float g = MIN (gu[2 * j], gate->limit);
              float u = CLAMP (gu[2 * j + 1], -gate->limit, gate->limit);
              float sig = R (1.0f / (1.0f + expf (-R (gate->alpha * g))));
              float glu = R (g * sig);
              o[j] = R (R (u + 1.0f) * glu);
            }
        }
      else
        {
          const float *g = up + r * 2 * inter;
          const float *u = g + inter;
          for (gsize j = 0; j < inter; j++)
            o[j] = R (R (activate (gate->activation, g[j])) * u[j]);
        }
    }
#undef R
}

/**
 * moe_cpu_experts_init: (skip)
 * @view: the view to fill
 * @experts: validated experts whose weights are on the CPU
 * @act_dtype: the dtype of the hidden states: with BF16 or F16 every
 *   intermediate result is rounded to it, as transformers computes
 */
void
moe_cpu_experts_init (MoeCpuExperts *view,
                      MoeExperts    *experts,
                      MoeDType       act_dtype)
{
  MoeTensor *up = moe_experts_get_up_weight (experts);
  MoeTensor *down = moe_experts_get_down_weight (experts);
  MoeTensor *up_bias = moe_experts_get_up_bias (experts);
  MoeTensor *down_bias = moe_experts_get_down_bias (experts);

  memset (view, 0, sizeof *view);
  view->num_experts = moe_experts_get_num_experts (experts);
  view->hidden = moe_experts_get_hidden_size (experts);
  view->inter = moe_experts_get_intermediate_size (experts);
  view->transposed = moe_experts_get_is_transposed (experts);
  view->gate.has_gate = moe_experts_get_has_gate (experts);
  view->gate.interleaved = moe_experts_get_gate_layout (experts) == MOE_GATE_LAYOUT_INTERLEAVED;
  view->gate.alpha = (float) moe_experts_get_swiglu_alpha (experts);
  view->gate.limit = (float) moe_experts_get_swiglu_limit (experts);
  view->gate.round = act_dtype;
  if (!moe_cpu_activation_from_name (moe_experts_get_activation (experts), &view->gate.activation))
    g_assert_not_reached ();   /* moe_experts_validate() refuses unknown names */
  view->up_out = view->gate.has_gate ? 2 * view->inter : view->inter;
  view->up_dtype = moe_tensor_get_dtype (up);
  view->down_dtype = moe_tensor_get_dtype (down);
  view->up = moe_tensor_get_data (up);
  view->down = moe_tensor_get_data (down);
  if (up_bias != NULL)
    {
      view->up_bias = moe_tensor_get_data (up_bias);
      view->up_bias_dtype = moe_tensor_get_dtype (up_bias);
    }
  if (down_bias != NULL)
    {
      view->down_bias = moe_tensor_get_data (down_bias);
      view->down_bias_dtype = moe_tensor_get_dtype (down_bias);
    }
  {
    MoeTensor *us = moe_experts_get_up_weight_scale (experts);
    MoeTensor *ds = moe_experts_get_down_weight_scale (experts);
    if (us != NULL)
      {
        view->up_scale = moe_tensor_get_data (us);
        view->up_scale_dtype = moe_tensor_get_dtype (us);
        view->up_scale_rows = moe_tensor_get_dim (us, 1);
        /* gate and up quantized as two matrices: ⌈I/128⌉ scale rows each */
        if (view->up_dtype == MOE_DTYPE_F8E4M3 && view->gate.has_gate &&
            view->up_scale_rows == 2 * ((view->inter + 127) / 128) &&
            view->up_scale_rows != (2 * view->inter + 127) / 128)
          view->up_scale_split = view->inter;
      }
    if (ds != NULL)
      {
        view->down_scale = moe_tensor_get_data (ds);
        view->down_scale_dtype = moe_tensor_get_dtype (ds);
        view->down_scale_rows = moe_tensor_get_dim (ds, 1);
      }
  }
}

/* Bytes of one expert's [n, k] matrix: FP4 packs two values per byte. */
static gsize
expert_matrix_bytes (MoeDType dtype, gsize n, gsize k)
{
  return dtype == MOE_DTYPE_I8 ? n * (k / 2) : n * k * moe_dtype_get_size (dtype);
}

/* One expert's share of a scale tensor [E, rows, cols]. */
static gconstpointer
expert_scale (const guint8 *scale, MoeDType scale_dtype, MoeDType weight_dtype,
              gsize rows, gsize n, gsize k, guint expert)
{
  gsize per = weight_dtype == MOE_DTYPE_I8 ? n * (k / 32) : rows * ((k + 127) / 128);
  return scale != NULL ? scale + (gsize) expert * per * moe_dtype_get_size (scale_dtype) : NULL;
}

/**
 * moe_cpu_experts_run: (skip)
 * @view: the experts
 * @expert: an expert id below `num_experts`
 * @x: `[m, H]` float32 rows routed to @expert
 * @m: the number of rows
 * @y: `[m, H]` float32 output: `down(gate(up(x)))`, biases included,
 *   not yet scaled by routing weights
 */
void
moe_cpu_experts_run (const MoeCpuExperts *view,
                     guint                expert,
                     const float         *x,
                     gsize                m,
                     float               *y)
{
  gsize hid = view->hidden, inter = view->inter, upn = view->up_out;
  MoeCpuMatrix up = {
    .dtype = view->up_dtype,
    .data = view->up + (gsize) expert * expert_matrix_bytes (view->up_dtype, upn, hid),
    .n = upn, .k = hid, .transposed = view->transposed,
    .scale = expert_scale (view->up_scale, view->up_scale_dtype, view->up_dtype,
                           view->up_scale_rows, upn, hid, expert),
    .scale_dtype = view->up_scale_dtype, .scale_rows = view->up_scale_rows,
    .scale_split = view->up_scale_split,
  };
  MoeCpuMatrix down = {
    .dtype = view->down_dtype,
    .data = view->down + (gsize) expert * expert_matrix_bytes (view->down_dtype, hid, inter),
    .n = hid, .k = inter, .transposed = view->transposed,
    .scale = expert_scale (view->down_scale, view->down_scale_dtype, view->down_dtype,
                           view->down_scale_rows, hid, inter, expert),
    .scale_dtype = view->down_scale_dtype, .scale_rows = view->down_scale_rows,
  };
  float *u, *h;

  if (m == 0)
    return;

  u = g_new (float, m * upn);
  h = g_new (float, m * inter);

  moe_cpu_matmul (x, m, &up, u);
  moe_cpu_round_array (u, m * upn, view->gate.round);
  if (view->up_bias != NULL)
    {
      moe_cpu_add_bias (u, m, upn, view->up_bias_dtype,
                        view->up_bias + (gsize) expert * upn * moe_dtype_get_size (view->up_bias_dtype));
      moe_cpu_round_array (u, m * upn, view->gate.round);
    }
  moe_cpu_apply_gate (u, m, inter, &view->gate, h);
  moe_cpu_matmul (h, m, &down, y);
  moe_cpu_round_array (y, m * hid, view->gate.round);
  if (view->down_bias != NULL)
    {
      moe_cpu_add_bias (y, m, hid, view->down_bias_dtype,
                        view->down_bias + (gsize) expert * hid * moe_dtype_get_size (view->down_bias_dtype));
      moe_cpu_round_array (y, m * hid, view->gate.round);
    }

  g_free (u);
  g_free (h);
}

/**
 * moe_cpu_tensor_dup_f32: (skip)
 * @tensor: a CPU tensor of a float dtype
 *
 * Returns: (transfer full): its elements widened to float32; free with g_free()
 */
float *
moe_cpu_tensor_dup_f32 (MoeTensor *tensor)
{
  gsize n = (gsize) moe_tensor_get_n_elements (tensor);
  float *out = g_new (float, MAX (n, 1));

  moe_cpu_convert (moe_tensor_get_dtype (tensor), moe_tensor_get_data (tensor),
                   MOE_DTYPE_F32, out, n);
  return out;
}

/**
 * moe_cpu_tensor_from_f32: (skip)
 * @data: float32 elements
 * @dtype: the dtype of the new tensor (rounded to nearest even)
 * @shape: (array length=n_dims): its dimensions
 * @n_dims: the number of dimensions
 * @error: return location for a #GError
 *
 * Returns: (transfer full): a new CPU tensor
 */
MoeTensor *
moe_cpu_tensor_from_f32 (const float   *data,
                         MoeDType       dtype,
                         const gint64  *shape,
                         guint          n_dims,
                         GError       **error)
{
  MoeTensor *out = moe_tensor_new_empty (NULL, dtype, shape, n_dims, error);

  if (out != NULL)
    moe_cpu_convert (MOE_DTYPE_F32, data, dtype, moe_tensor_get_mutable_data (out),
                     (gsize) moe_tensor_get_n_elements (out));
  return out;
}
