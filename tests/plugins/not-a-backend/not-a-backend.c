/* not-a-backend.c: types that are not instantiable experts backends
 *
 * FIXTURE_VARIANT 1 registers MoeTestNotABackend, a plain GObject
 * subclass; 2 registers MoeTestAbstractBackend, an abstract
 * MoeExpertsBackend subclass. Each keyfile names its module's type.
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#include "fixture-backend.h"

#if FIXTURE_VARIANT == 1

typedef struct { GObject parent_instance; } MoeTestNotABackend;
typedef struct { GObjectClass parent_class; } MoeTestNotABackendClass;
static GType moe_test_not_a_backend_get_type (void);
G_DEFINE_FINAL_TYPE (MoeTestNotABackend, moe_test_not_a_backend, G_TYPE_OBJECT)

static void
moe_test_not_a_backend_class_init (MoeTestNotABackendClass *klass)
{
}

static void
moe_test_not_a_backend_init (MoeTestNotABackend *self)
{
}

static gboolean
not_a_backend_init (GError **error)
{
  g_type_ensure (moe_test_not_a_backend_get_type ());
  return TRUE;
}

MOE_PLUGIN_DEFINE (not_a_backend, not_a_backend_init)

#elif FIXTURE_VARIANT == 2

typedef struct { MoeExpertsBackend parent_instance; } MoeTestAbstractBackend;
typedef struct { MoeExpertsBackendClass parent_class; } MoeTestAbstractBackendClass;
static GType moe_test_abstract_backend_get_type (void);
G_DEFINE_ABSTRACT_TYPE (MoeTestAbstractBackend, moe_test_abstract_backend, MOE_TYPE_EXPERTS_BACKEND)

static void
moe_test_abstract_backend_class_init (MoeTestAbstractBackendClass *klass)
{
  MOE_EXPERTS_BACKEND_CLASS (klass)->forward = fixture_backend_forward;
}

static void
moe_test_abstract_backend_init (MoeTestAbstractBackend *self)
{
}

static gboolean
abstract_init (GError **error)
{
  g_type_ensure (moe_test_abstract_backend_get_type ());
  return TRUE;
}

MOE_PLUGIN_DEFINE (abstract, abstract_init)

#else
# error "FIXTURE_VARIANT must be 1 or 2"
#endif
