/* moe-plugin-info.c: what a plugin's .plugin keyfile says about it
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#include "config.h"

#include <string.h>

#include "moe-private.h"
#include "moe-plugin-info-private.h"

#define GROUP "Moe Plugin"

/**
 * MoePluginInfo:
 *
 * A plugin as its `.plugin` keyfile describes it. Reading it opens no
 * module: the module is opened the first time its backend or device is used.
 *
 * |[
 * [Moe Plugin]
 * Module=grouped_mm          # the module is libmoe-grouped_mm.so beside this file
 * Name=grouped_mm            # the backend or device name users ask for
 * Kind=experts-backend       # or "device"
 * Type=MoeGroupedMmBackend   # the GType the module registers
 * Abi=1                      # MOE_PLUGIN_ABI_VERSION
 * Priority=100
 * Devices=cpu;
 * Description=…
 * ]|
 */
struct _MoePluginInfo
{
  GObject        parent_instance;

  char          *keyfile_path;
  char          *module_name;
  char          *module_path;
  char          *name;
  char          *type_name;
  char          *description;
  char          *version;
  char         **devices;
  MoePluginKind  kind;
  int            priority;
  guint          abi;
  GKeyFile      *keyfile;

  /* loading state, guarded by the registry */
  gboolean       loaded;
  GType          type;
  GError        *load_error;
};

G_DEFINE_FINAL_TYPE (MoePluginInfo, moe_plugin_info, G_TYPE_OBJECT)

static void
moe_plugin_info_finalize (GObject *object)
{
  MoePluginInfo *self = MOE_PLUGIN_INFO (object);

  g_free (self->keyfile_path);
  g_free (self->module_name);
  g_free (self->module_path);
  g_free (self->name);
  g_free (self->type_name);
  g_free (self->description);
  g_free (self->version);
  g_strfreev (self->devices);
  g_clear_pointer (&self->keyfile, g_key_file_unref);
  g_clear_error (&self->load_error);

  G_OBJECT_CLASS (moe_plugin_info_parent_class)->finalize (object);
}

static void
moe_plugin_info_class_init (MoePluginInfoClass *klass)
{
  G_OBJECT_CLASS (klass)->finalize = moe_plugin_info_finalize;
}

static void
moe_plugin_info_init (MoePluginInfo *self)
{
}

static gboolean
is_identifier (const char *s)
{
  if (s == NULL || *s == '\0')
    return FALSE;
  for (; *s; s++)
    if (!g_ascii_isalnum (*s) && *s != '_')
      return FALSE;
  return TRUE;
}

/* GType's own rule: a letter or '_' first, then letters, digits, '_', '-', '+' */
static gboolean
is_type_name (const char *s)
{
  if (s == NULL || strlen (s) < 3 || !(g_ascii_isalpha (*s) || *s == '_'))
    return FALSE;
  for (; *s; s++)
    if (!g_ascii_isalnum (*s) && *s != '_' && *s != '-' && *s != '+')
      return FALSE;
  return TRUE;
}

static char *
require_string (GKeyFile    *kf,
                const char  *path,
                const char  *key,
                GError     **error)
{
  g_autoptr(GError) local = NULL;
  char *v = g_key_file_get_string (kf, GROUP, key, &local);

  if (v == NULL || *v == '\0')
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_PLUGIN_KEYFILE,
                   "%s: the [%s] group needs a non-empty %s= key", path, GROUP, key);
      g_free (v);
      return NULL;
    }
  return v;
}

/**
 * moe_plugin_info_new_from_file:
 * @path: a `.plugin` keyfile
 * @error: return location for a #GError
 *
 * Reads a plugin's keyfile. The module is expected beside it, named
 * `libmoe-<Module>.so`.
 *
 * Returns: (transfer full): the plugin info, or %NULL with
 *   %MOE_ERROR_PLUGIN_KEYFILE if the keyfile is malformed
 */
MoePluginInfo *
moe_plugin_info_new_from_file (const char  *path,
                               GError     **error)
{
  g_autoptr(MoePluginInfo) self = NULL;
  g_autoptr(GKeyFile) kf = g_key_file_new ();
  g_autoptr(GError) local = NULL;
  g_autofree char *kind = NULL;
  g_autofree char *dir = NULL;
  g_autofree char *file = NULL;
  g_autofree char *abi = NULL;

  g_return_val_if_fail (path != NULL, NULL);

  if (!g_key_file_load_from_file (kf, path, G_KEY_FILE_NONE, &local))
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_PLUGIN_KEYFILE,
                   "%s: not a valid keyfile: %s", path, local->message);
      return NULL;
    }
  if (!g_key_file_has_group (kf, GROUP))
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_PLUGIN_KEYFILE,
                   "%s: no [%s] group", path, GROUP);
      return NULL;
    }

  self = g_object_new (MOE_TYPE_PLUGIN_INFO, NULL);
  self->keyfile_path = g_strdup (path);

  if (!(self->module_name = require_string (kf, path, "Module", error)) ||
      !(self->name = require_string (kf, path, "Name", error)) ||
      !(self->type_name = require_string (kf, path, "Type", error)) ||
      !(kind = require_string (kf, path, "Kind", error)) ||
      !(abi = require_string (kf, path, "Abi", error)))
    return NULL;

  if (!is_identifier (self->module_name))
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_PLUGIN_KEYFILE,
                   "%s: Module=%s must be letters, digits and '_' only", path, self->module_name);
      return NULL;
    }
  if (!g_utf8_validate (self->name, -1, NULL) || strchr (self->name, '/') != NULL)
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_PLUGIN_KEYFILE,
                   "%s: Name= must be UTF-8 without '/'", path);
      return NULL;
    }
  if (!is_type_name (self->type_name))
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_PLUGIN_KEYFILE,
                   "%s: Type=%s is not a valid GType name", path, self->type_name);
      return NULL;
    }

  if (g_str_equal (kind, "experts-backend"))
    self->kind = MOE_PLUGIN_KIND_EXPERTS_BACKEND;
  else if (g_str_equal (kind, "device"))
    self->kind = MOE_PLUGIN_KIND_DEVICE;
  else
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_PLUGIN_KEYFILE,
                   "%s: Kind=%s is not one of experts-backend, device", path, kind);
      return NULL;
    }

  {
    guint64 v;
    if (!g_ascii_string_to_unsigned (abi, 10, 0, G_MAXUINT, &v, NULL))
      {
        g_set_error (error, MOE_ERROR, MOE_ERROR_PLUGIN_KEYFILE,
                     "%s: Abi=%s is not a number", path, abi);
        return NULL;
      }
    self->abi = (guint) v;
  }

  if (g_key_file_has_key (kf, GROUP, "Priority", NULL))
    {
      self->priority = g_key_file_get_integer (kf, GROUP, "Priority", &local);
      if (local != NULL)
        {
          g_set_error (error, MOE_ERROR, MOE_ERROR_PLUGIN_KEYFILE,
                       "%s: Priority= is not an integer", path);
          return NULL;
        }
    }

  self->description = g_key_file_get_locale_string (kf, GROUP, "Description", NULL, NULL);
  self->version = g_key_file_get_string (kf, GROUP, "Version", NULL);
  self->devices = g_key_file_get_string_list (kf, GROUP, "Devices", NULL, NULL);
  if (self->devices == NULL)
    self->devices = g_new0 (char *, 1);

  dir = g_path_get_dirname (path);
  file = g_strdup_printf ("libmoe-%s.so", self->module_name);
  self->module_path = g_build_filename (dir, file, NULL);
  self->keyfile = g_steal_pointer (&kf);

  return g_steal_pointer (&self);
}

/**
 * moe_plugin_info_get_name:
 * @self: a plugin info
 *
 * Returns: the name users ask for: the experts backend's or device's name
 */
const char *
moe_plugin_info_get_name (MoePluginInfo *self)
{
  g_return_val_if_fail (MOE_IS_PLUGIN_INFO (self), NULL);
  return self->name;
}

/**
 * moe_plugin_info_get_module_name:
 * @self: a plugin info
 *
 * Returns: the keyfile's `Module=`
 */
const char *
moe_plugin_info_get_module_name (MoePluginInfo *self)
{
  g_return_val_if_fail (MOE_IS_PLUGIN_INFO (self), NULL);
  return self->module_name;
}

/**
 * moe_plugin_info_get_module_path:
 * @self: a plugin info
 *
 * Returns: the absolute path of the module file
 */
const char *
moe_plugin_info_get_module_path (MoePluginInfo *self)
{
  g_return_val_if_fail (MOE_IS_PLUGIN_INFO (self), NULL);
  return self->module_path;
}

/**
 * moe_plugin_info_get_keyfile_path:
 * @self: a plugin info
 *
 * Returns: the path of the `.plugin` keyfile
 */
const char *
moe_plugin_info_get_keyfile_path (MoePluginInfo *self)
{
  g_return_val_if_fail (MOE_IS_PLUGIN_INFO (self), NULL);
  return self->keyfile_path;
}

/**
 * moe_plugin_info_get_type_name:
 * @self: a plugin info
 *
 * Returns: the name of the GType the module registers
 */
const char *
moe_plugin_info_get_type_name (MoePluginInfo *self)
{
  g_return_val_if_fail (MOE_IS_PLUGIN_INFO (self), NULL);
  return self->type_name;
}

/**
 * moe_plugin_info_get_description:
 * @self: a plugin info
 *
 * Returns: (nullable): a description
 */
const char *
moe_plugin_info_get_description (MoePluginInfo *self)
{
  g_return_val_if_fail (MOE_IS_PLUGIN_INFO (self), NULL);
  return self->description;
}

/**
 * moe_plugin_info_get_version:
 * @self: a plugin info
 *
 * Returns: (nullable): the plugin's version
 */
const char *
moe_plugin_info_get_version (MoePluginInfo *self)
{
  g_return_val_if_fail (MOE_IS_PLUGIN_INFO (self), NULL);
  return self->version;
}

/**
 * moe_plugin_info_get_kind:
 * @self: a plugin info
 *
 * Returns: what the plugin provides
 */
MoePluginKind
moe_plugin_info_get_kind (MoePluginInfo *self)
{
  g_return_val_if_fail (MOE_IS_PLUGIN_INFO (self), 0);
  return self->kind;
}

/**
 * moe_plugin_info_get_priority:
 * @self: a plugin info
 *
 * Returns: the keyfile's `Priority=` (0 if absent)
 */
int
moe_plugin_info_get_priority (MoePluginInfo *self)
{
  g_return_val_if_fail (MOE_IS_PLUGIN_INFO (self), 0);
  return self->priority;
}

/**
 * moe_plugin_info_get_abi:
 * @self: a plugin info
 *
 * Returns: the plugin ABI the keyfile declares
 */
guint
moe_plugin_info_get_abi (MoePluginInfo *self)
{
  g_return_val_if_fail (MOE_IS_PLUGIN_INFO (self), 0);
  return self->abi;
}

/**
 * moe_plugin_info_get_devices:
 * @self: a plugin info
 *
 * Returns: (transfer none) (array zero-terminated=1): the devices the plugin runs on
 */
const char * const *
moe_plugin_info_get_devices (MoePluginInfo *self)
{
  g_return_val_if_fail (MOE_IS_PLUGIN_INFO (self), NULL);
  return (const char * const *) self->devices;
}

/**
 * moe_plugin_info_dup_extra:
 * @self: a plugin info
 * @key: a key of the `[Moe Plugin]` group, such as `X-Moe-Dtypes`
 *
 * Returns: (transfer full) (nullable): the key's value
 */
char *
moe_plugin_info_dup_extra (MoePluginInfo *self,
                           const char    *key)
{
  g_return_val_if_fail (MOE_IS_PLUGIN_INFO (self), NULL);
  return g_key_file_get_string (self->keyfile, GROUP, key, NULL);
}

/**
 * moe_plugin_info_is_loaded:
 * @self: a plugin info
 *
 * Returns: %TRUE once the module has been opened and initialised
 */
gboolean
moe_plugin_info_is_loaded (MoePluginInfo *self)
{
  g_return_val_if_fail (MOE_IS_PLUGIN_INFO (self), FALSE);
  return self->loaded;
}

static GType
expected_base_type (MoePluginKind kind)
{
  return kind == MOE_PLUGIN_KIND_DEVICE ? MOE_TYPE_DEVICE : MOE_TYPE_EXPERTS_BACKEND;
}

/* Opens the module, checks its descriptor and registers its type. A failure
 * is remembered, so the module is tried once. Called under the registry lock. */
GType
_moe_plugin_info_load (MoePluginInfo  *self,
                       GError        **error)
{
  g_autoptr(GError) local = NULL;
  g_autofree char *symbol = NULL;
  const MoePluginDesc *(*get_desc) (void) = NULL;
  const MoePluginDesc *desc;
  GModule *module;
  GType type;

  if (self->loaded)
    return self->type;
  if (self->load_error != NULL)
    {
      g_propagate_error (error, g_error_copy (self->load_error));
      return G_TYPE_INVALID;
    }

#define FAIL(code, ...) G_STMT_START {                                          \
    g_set_error (&self->load_error, MOE_ERROR, code, __VA_ARGS__);               \
    g_propagate_error (error, g_error_copy (self->load_error));                  \
    return G_TYPE_INVALID;                                                       \
  } G_STMT_END

  if (self->abi != MOE_PLUGIN_ABI_VERSION)
    FAIL (MOE_ERROR_PLUGIN_ABI, "Plugin “%s” (%s) declares plugin ABI %u; this libmoe has ABI %d",
          self->name, self->keyfile_path, self->abi, MOE_PLUGIN_ABI_VERSION);

  if (!g_path_is_absolute (self->module_path))
    FAIL (MOE_ERROR_PLUGIN_LOAD, "Plugin “%s”: module path %s is not absolute",
          self->name, self->module_path);

  module = g_module_open_full (self->module_path, G_MODULE_BIND_LOCAL, &local);
  if (module == NULL)
    FAIL (MOE_ERROR_PLUGIN_LOAD, "Plugin “%s”: could not open %s: %s",
          self->name, self->module_path, local->message);

  symbol = g_strdup_printf ("moe_plugin_%s_get_desc", self->module_name);
  if (!g_module_symbol (module, symbol, (gpointer *) &get_desc) || get_desc == NULL)
    {
      g_module_close (module);
      FAIL (MOE_ERROR_PLUGIN_SYMBOL, "Plugin “%s”: %s does not export %s()",
            self->name, self->module_path, symbol);
    }

  desc = get_desc ();
  if (desc == NULL || desc->abi_version != MOE_PLUGIN_ABI_VERSION ||
      desc->major_version != MOE_MAJOR_VERSION || desc->minor_version > MOE_MINOR_VERSION)
    {
      guint abi = desc ? desc->abi_version : 0;
      guint major = desc ? desc->major_version : 0, minor = desc ? desc->minor_version : 0;
      g_module_close (module);
      FAIL (MOE_ERROR_PLUGIN_ABI,
            "Plugin “%s”: %s was built for plugin ABI %u and libmoe %u.%u; "
            "this is ABI %d, libmoe %d.%d (the ABI must match, the major version too, "
            "and the minor version may not be newer)",
            self->name, self->module_path, abi, major, minor,
            MOE_PLUGIN_ABI_VERSION, MOE_MAJOR_VERSION, MOE_MINOR_VERSION);
    }
  if (desc->module_name == NULL || !g_str_equal (desc->module_name, self->module_name))
    {
      /* the descriptor lives in the module: copy what the message needs first */
      g_autofree char *desc_name = g_strdup (desc->module_name ? desc->module_name : "(null)");
      g_module_close (module);
      FAIL (MOE_ERROR_PLUGIN_INIT, "Plugin “%s”: the module calls itself “%s” but %s says Module=%s",
            self->name, desc_name, self->keyfile_path, self->module_name);
    }

  /* Plugins are never unloaded: their types, and the CUDA runtime's global
   * state, must outlive every object. */
  g_module_make_resident (module);

  /* a device plugin that finds no hardware keeps its NO_DEVICE code */
  if (desc->init != NULL && !desc->init (&local))
    FAIL (g_error_matches (local, MOE_ERROR, MOE_ERROR_NO_DEVICE) ? MOE_ERROR_NO_DEVICE : MOE_ERROR_PLUGIN_INIT,
          "Plugin “%s”: init failed: %s", self->name, local ? local->message : "no reason given");

  type = g_type_from_name (self->type_name);
  if (type == G_TYPE_INVALID)
    FAIL (MOE_ERROR_PLUGIN_INIT, "Plugin “%s”: %s says Type=%s, but the module registered no such type",
          self->name, self->keyfile_path, self->type_name);
  if (!g_type_is_a (type, expected_base_type (self->kind)) || G_TYPE_IS_ABSTRACT (type))
    FAIL (MOE_ERROR_PLUGIN_INIT, "Plugin “%s”: type %s is not an instantiable %s",
          self->name, self->type_name, g_type_name (expected_base_type (self->kind)));

#undef FAIL

  self->type = type;
  self->loaded = TRUE;
  return type;
}
