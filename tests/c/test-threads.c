/* test-threads.c: the threading contract — concurrent forwards, experts-map
 * changes from another thread during a generation, cancellation at every
 * step, unref while an async call runs — and out-of-memory as a GError.
 * Also run under ThreadSanitizer by tools/tsan.sh.
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#include <string.h>
#include <sys/resource.h>
#include <libmoe.h>
#include <moe-plugin.h>

#include "moe-test-util.h"

static MoeModel *
load (const char *family)
{
  g_autoptr(GError) error = NULL;
  g_autofree char *path = moe_test_data_path ("models", family, NULL);
  g_autoptr(MoeLoadOptions) opts = moe_load_options_new ();
  MoeModel *model;

  moe_load_options_set_dtype (opts, "float32");
  model = moe_model_new_from_pretrained (path, opts, NULL, &error);
  g_assert_no_error (error);
  return model;
}

typedef struct {
  MoeModel  *model;
  MoeTensor *ids;
  MoeTensor *ref;
  gint       failures;
} Shared;

static gpointer
forward_thread (gpointer data)
{
  Shared *s = data;

  for (int i = 0; i < 3; i++)
    {
      g_autoptr(GError) error = NULL;
      g_autoptr(MoeTensor) logits = moe_model_forward (s->model, s->ids, &error);
      if (logits == NULL || moe_test_rel_error (logits, s->ref) > 1e-4)
        g_atomic_int_inc (&s->failures);
    }
  return NULL;
}

/* Forwards from several threads at once are serialised, never racy. */
static void
test_concurrent_forwards (void)
{
  Shared s = { load ("qwen2_moe"),
               moe_test_model_reference ("qwen2_moe", "reference.safetensors", "input_ids"),
               moe_test_model_reference ("qwen2_moe", "reference.safetensors", "logits"), 0 };
  GThread *threads[4];

  for (guint i = 0; i < G_N_ELEMENTS (threads); i++)
    threads[i] = g_thread_new ("forward", forward_thread, &s);
  for (guint i = 0; i < G_N_ELEMENTS (threads); i++)
    g_thread_join (threads[i]);
  g_assert_cmpint (s.failures, ==, 0);
  g_object_unref (s.model);
  g_object_unref (s.ids);
  g_object_unref (s.ref);
}

typedef struct {
  MoeModel *model;
  gint      stop;
  guint     switches;
} Switcher;

static gpointer
switch_thread (gpointer data)
{
  Switcher *w = data;
  const char *names[] = { "eager", "batched_mm", "grouped_mm" };

  while (!g_atomic_int_get (&w->stop))
    {
      g_assert_true (moe_model_set_experts_implementation (w->model, names[w->switches % 3], NULL));
      w->switches++;
      g_usleep (200);
    }
  return NULL;
}

/* The map changes from another thread while a generation runs; the change
 * applies at step boundaries and the tokens are those of any backend. */
static void
test_switch_during_generation (void)
{
  Switcher w = { load ("mixtral"), 0, 0 };
  g_autoptr(MoeTensor) ids = moe_test_model_reference ("mixtral", "reference.safetensors", "input_ids");
  g_autoptr(MoeTensor) generated = moe_test_model_reference ("mixtral", "reference.safetensors", "generated");
  g_autoptr(MoeTensor) prompt = moe_test_first_row (ids);
  g_autoptr(MoeGenerationConfig) cfg = moe_generation_config_new ();
  GThread *thread;

  g_object_set (cfg, "max-new-tokens", 12, NULL);
  thread = g_thread_new ("switch", switch_thread, &w);
  for (int i = 0; i < 5; i++)
    {
      g_autoptr(GError) error = NULL;
      g_autoptr(MoeTensor) out = moe_model_generate (w.model, prompt, cfg, NULL, &error);
      g_assert_no_error (error);
      g_assert_cmpmem (moe_tensor_get_data (out), moe_tensor_get_n_bytes (out),
                       moe_tensor_get_data (generated), moe_tensor_get_n_bytes (generated));
    }
  g_atomic_int_set (&w.stop, 1);
  g_thread_join (thread);
  g_assert_cmpuint (w.switches, >, 0);
  g_object_unref (w.model);
}

typedef struct {
  GMainLoop    *loop;
  GCancellable *cancel;
  guint         cancel_after;
  guint         tokens;
  MoeTensor    *result;
  GError       *error;
} Run;

static void
on_token (MoeModel *model, MoeTensor *tokens, gpointer data)
{
  Run *r = data;
  if (++r->tokens == r->cancel_after)
    g_cancellable_cancel (r->cancel);
}

static void
on_done (GObject *source, GAsyncResult *res, gpointer data)
{
  Run *r = data;
  r->result = moe_model_generate_finish (MOE_MODEL (source), res, &r->error);
  g_main_loop_quit (r->loop);
}

/* Cancelling at any step leaves the model usable and its map restored. */
static void
test_cancel_every_step (void)
{
  g_autoptr(MoeModel) model = load ("qwen3_moe");
  g_autoptr(MoeTensor) ids = moe_test_model_reference ("qwen3_moe", "reference.safetensors", "input_ids");
  g_autoptr(MoeTensor) generated = moe_test_model_reference ("qwen3_moe", "reference.safetensors", "generated");
  g_autoptr(MoeTensor) prompt = moe_test_first_row (ids);
  g_autoptr(MoeGenerationConfig) cfg = moe_generation_config_new ();

  g_object_set (cfg, "max-new-tokens", 12, NULL);
  moe_model_set_decode_switch (model, MOE_DECODE_SWITCH_ALWAYS);
  for (guint k = 1; k <= 12; k++)
    {
      Run r = { g_main_loop_new (NULL, FALSE), g_cancellable_new (), k, };
      g_autoptr(GHashTable) map = NULL;

      moe_model_generate_async (model, prompt, NULL, cfg, on_token, &r, NULL, r.cancel, on_done, &r);
      g_main_loop_run (r.loop);
      /* cancelled, or finished before the cancellation was seen */
      if (r.result == NULL)
        {
          g_assert_error (r.error, G_IO_ERROR, G_IO_ERROR_CANCELLED);
          g_clear_error (&r.error);
        }
      else
        g_clear_object (&r.result);
      map = moe_model_get_experts_implementation (model);
      g_assert_cmpstr (g_hash_table_lookup (map, ""), ==, "grouped_mm");
      g_assert_cmpint (moe_model_get_phase (model), ==, MOE_PHASE_IDLE);
      g_main_loop_unref (r.loop);
      g_object_unref (r.cancel);
    }
  {
    g_autoptr(GError) error = NULL;
    g_autoptr(MoeTensor) out = moe_model_generate (model, prompt, cfg, NULL, &error);
    g_assert_no_error (error);
    g_assert_cmpmem (moe_tensor_get_data (out), moe_tensor_get_n_bytes (out),
                     moe_tensor_get_data (generated), moe_tensor_get_n_bytes (generated));
  }
}

/* The caller drops its reference while the generation runs: the task keeps
 * the model alive until the callback, then it is freed. */
static void
test_unref_while_async (void)
{
  MoeModel *model = load ("olmoe");
  g_autoptr(MoeTensor) ids = moe_test_model_reference ("olmoe", "reference.safetensors", "input_ids");
  g_autoptr(MoeTensor) generated = moe_test_model_reference ("olmoe", "reference.safetensors", "generated");
  g_autoptr(MoeTensor) prompt = moe_test_first_row (ids);
  g_autoptr(MoeGenerationConfig) cfg = moe_generation_config_new ();
  Run r = { g_main_loop_new (NULL, FALSE), };

  g_object_set (cfg, "max-new-tokens", 12, NULL);
  g_object_add_weak_pointer (G_OBJECT (model), (gpointer *) &model);
  moe_model_generate_async (model, prompt, NULL, cfg, on_token, &r, NULL, NULL, on_done, &r);
  g_object_unref (model);
  g_assert_nonnull (model);
  g_main_loop_run (r.loop);
  g_assert_no_error (r.error);
  g_assert_cmpmem (moe_tensor_get_data (r.result), moe_tensor_get_n_bytes (r.result),
                   moe_tensor_get_data (generated), moe_tensor_get_n_bytes (generated));
  g_clear_object (&r.result);
  /* the last references go with idles the worker queues on this context */
  {
    gint64 deadline = g_get_monotonic_time () + 10 * G_USEC_PER_SEC;
    while (model != NULL && g_get_monotonic_time () < deadline)
      if (!g_main_context_iteration (NULL, FALSE))
        g_usleep (1000);
  }
  g_assert_null (model);
  g_main_loop_unref (r.loop);
}

/* Out of memory is a GError and the model stays usable: run in a child
 * whose address space is capped a little above what it uses now. */
static void
test_out_of_memory (void)
{
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  /* sanitizers reserve terabytes of shadow address space: a cap on the
   * address space means nothing there */
  g_test_skip ("an address-space limit cannot be tested under a sanitizer");
  return;
#endif
  if (g_test_subprocess ())
    {
      g_autoptr(MoeModel) model = load ("qwen3_moe");
      g_autoptr(GError) error = NULL;
      g_autofree char *status = NULL;
      gint64 T = 400000, shape[2] = { 1, T };
      g_autofree gint64 *big = g_new0 (gint64, T);
      g_autoptr(GBytes) big_bytes = g_bytes_new (big, T * 8);
      g_autoptr(MoeTensor) ids = moe_tensor_new_from_bytes (MOE_DTYPE_I64, shape, 2, big_bytes, NULL);
      g_autoptr(MoeTensor) small = moe_test_model_reference ("qwen3_moe", "reference.safetensors", "input_ids");
      g_autoptr(MoeTensor) ref = moe_test_model_reference ("qwen3_moe", "reference.safetensors", "logits");
      g_autoptr(MoeTensor) logits = NULL;
      struct rlimit limit;
      guint64 vm_kb = 0;

      g_assert_true (g_file_get_contents ("/proc/self/status", &status, NULL, NULL));
      for (char *line = strstr (status, "VmSize:"); line && vm_kb == 0; line = NULL)
        vm_kb = g_ascii_strtoull (line + 7, NULL, 10);
      g_assert_cmpuint (vm_kb, >, 0);
      limit.rlim_cur = limit.rlim_max = (vm_kb + 256 * 1024) * 1024;   /* 256 MB of head room */
      g_assert_cmpint (setrlimit (RLIMIT_AS, &limit), ==, 0);

      logits = moe_model_forward (model, ids, &error);
      g_assert_null (logits);
      g_assert_error (error, MOE_ERROR, MOE_ERROR_OUT_OF_MEMORY);
      g_clear_error (&error);
      {
        g_autoptr(MoeGenerationConfig) cfg = moe_generation_config_new ();
        g_autoptr(MoeTensor) out = moe_model_generate (model, ids, cfg, NULL, &error);
        g_assert_null (out);
        g_assert_error (error, MOE_ERROR, MOE_ERROR_OUT_OF_MEMORY);
        g_clear_error (&error);
      }
      logits = moe_model_forward (model, small, &error);
      g_assert_no_error (error);
      g_assert_cmpfloat (moe_test_rel_error (logits, ref), <=, 1e-4);
      return;
    }
  g_test_trap_subprocess (NULL, 0, G_TEST_SUBPROCESS_INHERIT_STDERR);
  g_test_trap_assert_passed ();
}

int
main (int argc, char *argv[])
{
  g_test_init (&argc, &argv, NULL);
  g_test_add_func ("/threads/concurrent-forwards", test_concurrent_forwards);
  g_test_add_func ("/threads/switch-during-generation", test_switch_during_generation);
  g_test_add_func ("/threads/cancel-every-step", test_cancel_every_step);
  g_test_add_func ("/threads/unref-while-async", test_unref_while_async);
  g_test_add_func ("/resources/out-of-memory", test_out_of_memory);
  return g_test_run ();
}
