/* skeleton.c: "skeleton", an experts backend built outside libmoe
 *
 * A complete, working backend that a third party can copy. It runs on the
 * CPU with libmoe's shared kernels (moe-cpu-kernels.h): for every token,
 * for every one of its K routing slots, one call runs the slot's expert on
 * that token's row, and the K results are summed with the routing weights:
 *
 *   out[t] = Σ_k  w[t,k] · expert_{e[t,k]} (x[t])
 *
 * A slot whose expert id equals the number of experts E is the
 * expert-parallel sentinel ("an expert this rank does not own") and adds
 * nothing.
 *
 * To make your own backend, rename:
 *   - MoeSkeletonBackend / moe_skeleton_backend / MOE_TYPE_SKELETON_BACKEND
 *     (the GType; it must match Type= in the .plugin keyfile);
 *   - the first argument of MOE_PLUGIN_DEFINE at the end of this file (it
 *     must match Module= in the keyfile and the module file name
 *     libmoe-<Module>.so, which meson.build sets);
 * then replace forward() with your own math (and is_supported() and
 * prepare() if you need them). Nothing else in libmoe has to change.
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#include <string.h>

/* The two headers a plugin needs: the plugin-author API (which includes
 * <libmoe.h>) and, for CPU backends, the shared CPU math. */
#include <moe-plugin.h>
#include <moe-cpu-kernels.h>

/* --- The backend type: a final subclass of MoeExpertsBackend. ---------- */

#define MOE_TYPE_SKELETON_BACKEND (moe_skeleton_backend_get_type ())
G_DECLARE_FINAL_TYPE (MoeSkeletonBackend, moe_skeleton_backend, MOE, SKELETON_BACKEND, MoeExpertsBackend)

struct _MoeSkeletonBackend
{
  MoeExpertsBackend parent_instance;

  /* Per-backend state goes here. libmoe creates one instance per registry
   * and shares it between threads: guard anything mutable. State that
   * belongs to one experts object (repacked weights…) goes through
   * moe_experts_set_backend_data() instead; see prepare() below. */
};

/* The module is made resident and never unloaded, so a plain (static)
 * G_DEFINE_FINAL_TYPE is right: no GTypeModule is needed. */
G_DEFINE_FINAL_TYPE (MoeSkeletonBackend, moe_skeleton_backend, MOE_TYPE_EXPERTS_BACKEND)

/* --- is_supported(): may this backend run these experts here? --------- */

/* libmoe asks before every forward. The parent's implementation accepts
 * the CPU device and refuses the others with MOE_ERROR_NOT_SUPPORTED; a GPU
 * backend would check for its device (and driver, compute capability…)
 * instead, and set @error to say what is missing. */
static gboolean
moe_skeleton_backend_is_supported (MoeExpertsBackend *backend,
                                   MoeDevice         *device,
                                   MoeExperts        *experts,
                                   GError           **error)
{
  MoeExpertsBackendClass *parent = MOE_EXPERTS_BACKEND_CLASS (moe_skeleton_backend_parent_class);

  /* An example of a backend-specific restriction would go here, e.g.
   * refusing an activation it does not implement:
   *
   *   if (!g_str_equal (moe_experts_get_activation (experts), "silu"))
   *     {
   *       g_set_error (error, MOE_ERROR, MOE_ERROR_NOT_SUPPORTED, "…");
   *       return FALSE;
   *     }
   *
   * moe_cpu_experts_run() handles every activation, gate layout, bias and
   * weight dtype libmoe knows, so the skeleton needs no such check. */
  return parent->is_supported (backend, device, experts, error);
}

/* --- prepare(): optional one-time work per experts object. ------------- */

/* Called at most once per experts object, before its first forward. The
 * skeleton reads the weights in place and has nothing to prepare; a real
 * backend might repack them here and keep the result with
 * moe_experts_set_backend_data (experts, backend, data, destroy), fetching
 * it in forward() with moe_experts_get_backend_data (experts, backend).
 * Leave the vfunc NULL when there is nothing to do, as below. */

/* --- forward(): the math. ----------------------------------------------- */

/* The inputs are already validated against @experts by libmoe:
 * @hidden_states is [T, H] (F32, BF16 or F16), @top_k_index is [T, K] I64
 * with every id in [0, E], @top_k_weights is [T, K]. Return [T, H] in the
 * dtype of @hidden_states, or NULL with @error set. */
static MoeTensor *
moe_skeleton_backend_forward (MoeExpertsBackend *backend,
                              MoeExperts        *experts,
                              MoeTensor         *hidden_states,
                              MoeTensor         *top_k_index,
                              MoeTensor         *top_k_weights,
                              GError           **error)
{
  MoeCpuExperts view;
  MoeDType dtype = moe_tensor_get_dtype (hidden_states);
  gsize T = moe_tensor_get_dim (hidden_states, 0);
  gsize K = moe_tensor_get_dim (top_k_index, 1);
  gsize H;
  const gint64 *ids = moe_tensor_get_data (top_k_index);
  /* activations and routing weights as float32, whatever their dtype */
  g_autofree float *x = moe_cpu_tensor_dup_f32 (hidden_states);
  g_autofree float *w = moe_cpu_tensor_dup_f32 (top_k_weights);
  g_autofree float *out = NULL;
  g_autofree float *y = NULL;

  /* a host view of the experts' weights (read in place, in their dtype);
   * with BF16 or F16 hidden states every intermediate is rounded to that
   * dtype, as transformers computes in it */
  moe_cpu_experts_init (&view, experts, dtype);
  H = view.hidden;
  out = g_new0 (float, MAX (T * H, 1));
  y = g_new (float, H);

  for (gsize t = 0; t < T; t++)
    {
      const float *row = x + t * H;
      float *acc = out + t * H;

      for (gsize k = 0; k < K; k++)
        {
          gint64 e = ids[t * K + k];
          float weight = w[t * K + k];

          /* id E: the expert-parallel sentinel, a slot that adds nothing */
          if (e >= (gint64) view.num_experts)
            continue;

          /* y = down_e (act (gate_e (row)) · up_e (row)), one row */
          moe_cpu_experts_run (&view, (guint) e, row, 1, y);
          for (gsize j = 0; j < H; j++)
            acc[j] += weight * y[j];
        }
    }

  /* back to the dtype of the hidden states, rounded once */
  return moe_cpu_tensor_from_f32 (out, dtype, moe_tensor_get_shape (hidden_states, NULL), 2, error);
}

static void
moe_skeleton_backend_class_init (MoeSkeletonBackendClass *klass)
{
  MoeExpertsBackendClass *backend_class = MOE_EXPERTS_BACKEND_CLASS (klass);

  backend_class->is_supported = moe_skeleton_backend_is_supported;
  backend_class->forward = moe_skeleton_backend_forward;
  /* backend_class->prepare = …;  optional, see above */
}

static void
moe_skeleton_backend_init (MoeSkeletonBackend *self)
{
}

/* --- The plugin's entry point. ----------------------------------------- */

/* Called once, when the backend is first asked for, after libmoe checked
 * the plugin ABI and version. Register the type named by the keyfile's
 * Type=. Return FALSE with @error set to refuse to load (a missing runtime
 * library, say); libmoe reports it as MOE_ERROR_PLUGIN_INIT. A GPU backend
 * on a machine without a GPU should still load, and say so from
 * is_supported() instead. */
static gboolean
skeleton_plugin_init (GError **error)
{
  g_type_ensure (MOE_TYPE_SKELETON_BACKEND);
  return TRUE;
}

/* Exports moe_plugin_skeleton_get_desc(), the one symbol libmoe looks up,
 * with this build's plugin ABI and libmoe version. "skeleton" must be the
 * keyfile's Module=. */
MOE_PLUGIN_DEFINE (skeleton, skeleton_plugin_init)
