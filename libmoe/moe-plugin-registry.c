/* moe-plugin-registry.c: discovers plugins and opens them on first use
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#include "config.h"

#include <string.h>
#ifdef __linux__
# include <sys/auxv.h>
#endif
#include <unistd.h>

#include "moe-private.h"
#include "moe-plugin-info-private.h"

/**
 * MoePluginRegistry:
 *
 * Finds plugins by their `.plugin` keyfiles and opens a module only when
 * its backend or device is first asked for. The registry is a
 * [iface@Gio.ListModel] of the [class@PluginInfo]s it accepted.
 *
 * The default registry ([func@PluginRegistry.get_default]) searches, in
 * order:
 *
 * 1. every absolute directory in `MOE_PLUGIN_PATH` (a `:`-separated list);
 * 2. `MOE_PLUGIN_SYSTEM_PATH` if it is set (even to the empty string, which
 *    searches nothing), else the installed directory
 *    `$libdir/libmoe-1/plugins`.
 *
 * Both variables are ignored in setuid and setgid processes, relative
 * entries are ignored always (the current directory is never searched), and
 * the first plugin with a given kind and name wins.
 *
 * The registry is thread-safe.
 */
struct _MoePluginRegistry
{
  GObject     parent_instance;

  GMutex      lock;
  GPtrArray  *search_paths;   /* char*, absolute */
  GPtrArray  *plugins;        /* MoePluginInfo*, accepted */
  GPtrArray  *rejected;       /* char*, "path: reason" */
  GHashTable *instances;      /* "kind/name" -> GObject (backend or device) */
  gboolean    scanned;
};

static void list_model_iface_init (GListModelInterface *iface);

G_DEFINE_FINAL_TYPE_WITH_CODE (MoePluginRegistry, moe_plugin_registry, G_TYPE_OBJECT,
                               G_IMPLEMENT_INTERFACE (G_TYPE_LIST_MODEL, list_model_iface_init))

static void
moe_plugin_registry_finalize (GObject *object)
{
  MoePluginRegistry *self = MOE_PLUGIN_REGISTRY (object);

  g_ptr_array_unref (self->search_paths);
  g_ptr_array_unref (self->plugins);
  g_ptr_array_unref (self->rejected);
  g_hash_table_unref (self->instances);
  g_mutex_clear (&self->lock);

  G_OBJECT_CLASS (moe_plugin_registry_parent_class)->finalize (object);
}

static void
moe_plugin_registry_class_init (MoePluginRegistryClass *klass)
{
  G_OBJECT_CLASS (klass)->finalize = moe_plugin_registry_finalize;
}

static void
moe_plugin_registry_init (MoePluginRegistry *self)
{
  g_mutex_init (&self->lock);
  self->search_paths = g_ptr_array_new_with_free_func (g_free);
  self->plugins = g_ptr_array_new_with_free_func (g_object_unref);
  self->rejected = g_ptr_array_new_with_free_func (g_free);
  self->instances = g_hash_table_new_full (g_str_hash, g_str_equal, g_free, g_object_unref);
}

gboolean
_moe_env_is_trusted (void)
{
#ifdef __linux__
  return getauxval (AT_SECURE) == 0;
#else
  return getuid () == geteuid () && getgid () == getegid ();
#endif
}

static int
compare_names (gconstpointer a,
               gconstpointer b)
{
  return strcmp (*(const char * const *) a, *(const char * const *) b);
}

static MoePluginInfo *
find_locked (MoePluginRegistry *self,
             MoePluginKind      kind,
             const char        *name)
{
  for (guint i = 0; i < self->plugins->len; i++)
    {
      MoePluginInfo *info = g_ptr_array_index (self->plugins, i);
      if (moe_plugin_info_get_kind (info) == kind &&
          g_str_equal (moe_plugin_info_get_name (info), name))
        return info;
    }
  return NULL;
}

static void
scan_directory_locked (MoePluginRegistry *self,
                       const char        *path)
{
  g_autoptr(GDir) dir = g_dir_open (path, 0, NULL);
  g_autoptr(GPtrArray) files = g_ptr_array_new_with_free_func (g_free);
  const char *entry;

  if (dir == NULL)
    return;
  while ((entry = g_dir_read_name (dir)) != NULL)
    if (g_str_has_suffix (entry, ".plugin"))
      g_ptr_array_add (files, g_strdup (entry));
  g_ptr_array_sort (files, compare_names);

  for (guint i = 0; i < files->len; i++)
    {
      g_autofree char *file = g_build_filename (path, g_ptr_array_index (files, i), NULL);
      g_autoptr(GError) error = NULL;
      g_autoptr(MoePluginInfo) info = moe_plugin_info_new_from_file (file, &error);

      if (info == NULL)
        {
          g_ptr_array_add (self->rejected, g_strdup (error->message));
          g_debug ("%s", error->message);
          continue;
        }
      if (find_locked (self, moe_plugin_info_get_kind (info), moe_plugin_info_get_name (info)))
        {
          g_debug ("%s: “%s” is already provided by an earlier plugin", file,
                   moe_plugin_info_get_name (info));
          continue;
        }
      g_ptr_array_add (self->plugins, g_steal_pointer (&info));
    }
}

static void
ensure_scanned_locked (MoePluginRegistry *self)
{
  if (self->scanned)
    return;
  self->scanned = TRUE;
  for (guint i = 0; i < self->search_paths->len; i++)
    scan_directory_locked (self, g_ptr_array_index (self->search_paths, i));
}

/**
 * moe_plugin_registry_new:
 *
 * Creates a registry with no search path: add directories with
 * [method@PluginRegistry.add_search_path]. Most code wants
 * [func@PluginRegistry.get_default].
 *
 * Returns: (transfer full): a new, empty registry
 */
MoePluginRegistry *
moe_plugin_registry_new (void)
{
  return g_object_new (MOE_TYPE_PLUGIN_REGISTRY, NULL);
}

static void
add_path_list (MoePluginRegistry *self,
               const char        *list)
{
  g_auto(GStrv) parts = g_strsplit (list, G_SEARCHPATH_SEPARATOR_S, -1);

  for (guint i = 0; parts[i] != NULL; i++)
    if (*parts[i] != '\0')
      moe_plugin_registry_add_search_path (self, parts[i]);
}

/**
 * moe_plugin_registry_get_default:
 *
 * Returns: (transfer none): the process-wide registry, searching
 *   `MOE_PLUGIN_PATH` and then the installed plugin directory
 */
MoePluginRegistry *
moe_plugin_registry_get_default (void)
{
  static gsize registry;

  if (g_once_init_enter (&registry))
    {
      MoePluginRegistry *self = moe_plugin_registry_new ();
      gboolean trusted = _moe_env_is_trusted ();
      const char *extra = trusted ? g_getenv ("MOE_PLUGIN_PATH") : NULL;
      const char *system = trusted ? g_getenv ("MOE_PLUGIN_SYSTEM_PATH") : NULL;

      if (extra != NULL)
        add_path_list (self, extra);
      if (system != NULL)
        add_path_list (self, system);
      else
        moe_plugin_registry_add_search_path (self, MOE_PLUGINDIR);

      g_once_init_leave (&registry, (gsize) self);
    }
  return (MoePluginRegistry *) registry;
}

/**
 * moe_plugin_registry_add_search_path:
 * @self: a registry
 * @path: an absolute directory holding `.plugin` files and their modules
 *
 * Appends @path to the directories searched. Relative paths are refused
 * with a warning: plugins are never loaded from the current directory.
 */
void
moe_plugin_registry_add_search_path (MoePluginRegistry *self,
                                     const char        *path)
{
  g_return_if_fail (MOE_IS_PLUGIN_REGISTRY (self));
  g_return_if_fail (path != NULL);

  if (!g_path_is_absolute (path))
    {
      g_warning ("Ignoring relative plugin path “%s”: plugin paths must be absolute", path);
      return;
    }

  moe_mutex_lock (&self->lock);
  for (guint i = 0; i < self->search_paths->len; i++)
    if (g_str_equal (g_ptr_array_index (self->search_paths, i), path))
      {
        moe_mutex_unlock (&self->lock);
        return;
      }
  g_ptr_array_add (self->search_paths, g_strdup (path));
  if (self->scanned)
    scan_directory_locked (self, path);
  moe_mutex_unlock (&self->lock);
}

/**
 * moe_plugin_registry_rescan:
 * @self: a registry
 *
 * Looks for `.plugin` files again. Plugins already accepted stay (their
 * modules may be open); new ones are added.
 */
void
moe_plugin_registry_rescan (MoePluginRegistry *self)
{
  g_return_if_fail (MOE_IS_PLUGIN_REGISTRY (self));

  moe_mutex_lock (&self->lock);
  g_ptr_array_set_size (self->rejected, 0);
  for (guint i = 0; i < self->search_paths->len; i++)
    scan_directory_locked (self, g_ptr_array_index (self->search_paths, i));
  self->scanned = TRUE;
  moe_mutex_unlock (&self->lock);
}

/* @device: NULL for every plugin of @kind, else those whose Devices= names
 * @device's kind ("cuda" for "cuda:1") */
static char **
list_kind (MoePluginRegistry *self,
           MoePluginKind      kind,
           const char        *device)
{
  GPtrArray *names = g_ptr_array_new ();
  g_autofree char *device_kind = device ? g_strndup (device, strcspn (device, ":")) : NULL;

  moe_mutex_lock (&self->lock);
  ensure_scanned_locked (self);
  for (guint i = 0; i < self->plugins->len; i++)
    {
      MoePluginInfo *info = g_ptr_array_index (self->plugins, i);
      if (moe_plugin_info_get_kind (info) == kind &&
          (device_kind == NULL || g_strv_contains (moe_plugin_info_get_devices (info), device_kind)))
        g_ptr_array_add (names, g_strdup (moe_plugin_info_get_name (info)));
    }
  moe_mutex_unlock (&self->lock);

  g_ptr_array_sort (names, compare_names);
  g_ptr_array_add (names, NULL);
  return (char **) g_ptr_array_free (names, FALSE);
}

/**
 * moe_plugin_registry_list_backends:
 * @self: a registry
 *
 * Lists the experts backends the registry found, without opening any module.
 *
 * Returns: (transfer full) (array zero-terminated=1): the backend names, sorted
 */
char **
moe_plugin_registry_list_backends (MoePluginRegistry *self)
{
  g_return_val_if_fail (MOE_IS_PLUGIN_REGISTRY (self), NULL);
  return list_kind (self, MOE_PLUGIN_KIND_EXPERTS_BACKEND, NULL);
}

/**
 * moe_plugin_registry_list_backends_for_device:
 * @self: a registry
 * @device: a device name: "cpu", "cuda", "cuda:1"…
 *
 * Lists the experts backends whose keyfile says they run on @device
 * (`Devices=`; "cuda:1" matches "cuda"), without opening any module. The
 * backends that need a GPU ("deepgemm", "sonicmoe"…) are not listed for
 * "cpu".
 *
 * Returns: (transfer full) (array zero-terminated=1): the backend names, sorted
 */
char **
moe_plugin_registry_list_backends_for_device (MoePluginRegistry *self,
                                              const char        *device)
{
  g_return_val_if_fail (MOE_IS_PLUGIN_REGISTRY (self), NULL);
  g_return_val_if_fail (device != NULL, NULL);
  return list_kind (self, MOE_PLUGIN_KIND_EXPERTS_BACKEND, device);
}

/**
 * moe_plugin_registry_list_devices:
 * @self: a registry
 *
 * Lists the devices plugins provide ("cpu" is built in and not listed).
 *
 * Returns: (transfer full) (array zero-terminated=1): the device names, sorted
 */
char **
moe_plugin_registry_list_devices (MoePluginRegistry *self)
{
  g_return_val_if_fail (MOE_IS_PLUGIN_REGISTRY (self), NULL);
  return list_kind (self, MOE_PLUGIN_KIND_DEVICE, NULL);
}

/**
 * moe_plugin_registry_lookup:
 * @self: a registry
 * @kind: what the plugin provides
 * @name: the backend or device name
 *
 * Returns: (transfer none) (nullable): the plugin's info
 */
MoePluginInfo *
moe_plugin_registry_lookup (MoePluginRegistry *self,
                            MoePluginKind      kind,
                            const char        *name)
{
  MoePluginInfo *info;

  g_return_val_if_fail (MOE_IS_PLUGIN_REGISTRY (self), NULL);
  g_return_val_if_fail (name != NULL, NULL);

  moe_mutex_lock (&self->lock);
  ensure_scanned_locked (self);
  info = find_locked (self, kind, name);
  moe_mutex_unlock (&self->lock);
  return info;
}

/**
 * moe_plugin_registry_dup_rejected:
 * @self: a registry
 *
 * Returns: (transfer full) (element-type utf8): why each refused `.plugin`
 *   file was refused
 */
GPtrArray *
moe_plugin_registry_dup_rejected (MoePluginRegistry *self)
{
  GPtrArray *out = g_ptr_array_new_with_free_func (g_free);

  g_return_val_if_fail (MOE_IS_PLUGIN_REGISTRY (self), out);

  moe_mutex_lock (&self->lock);
  ensure_scanned_locked (self);
  for (guint i = 0; i < self->rejected->len; i++)
    g_ptr_array_add (out, g_strdup (g_ptr_array_index (self->rejected, i)));
  moe_mutex_unlock (&self->lock);
  return out;
}

void
_moe_set_unknown_backend (GError            **error,
                          MoePluginRegistry  *registry,
                          const char         *name)
{
  g_auto(GStrv) names = moe_plugin_registry_list_backends (registry);
  g_autofree char *list = g_strjoinv (", ", names);

  g_set_error (error, MOE_ERROR, MOE_ERROR_UNKNOWN_BACKEND,
               "Unknown experts backend “%s”; available: %s", name,
               *list ? list : "none (no plugins found: check MOE_PLUGIN_PATH)");
}

static GObject *
get_instance (MoePluginRegistry  *self,
              MoePluginKind       kind,
              const char         *name,
              GError            **error)
{
  g_autofree char *key = g_strdup_printf ("%d/%s", kind, name);
  MoePluginInfo *info;
  GObject *instance;
  GType type;

  moe_mutex_lock (&self->lock);
  instance = g_hash_table_lookup (self->instances, key);
  if (instance != NULL)
    {
      moe_mutex_unlock (&self->lock);
      return instance;
    }

  ensure_scanned_locked (self);
  info = find_locked (self, kind, name);
  if (info == NULL)
    {
      moe_mutex_unlock (&self->lock);
      if (kind == MOE_PLUGIN_KIND_EXPERTS_BACKEND)
        _moe_set_unknown_backend (error, self, name);
      else
        {
          g_auto(GStrv) names = moe_plugin_registry_list_devices (self);
          g_autofree char *list = g_strjoinv (", ", names);
          g_set_error (error, MOE_ERROR, MOE_ERROR_NO_DEVICE,
                       "Unknown device “%s”; available: cpu%s%s", name, *list ? ", " : "", list);
        }
      return NULL;
    }

  type = _moe_plugin_info_load (info, error);
  if (type == G_TYPE_INVALID)
    {
      moe_mutex_unlock (&self->lock);
      return NULL;
    }

  instance = g_object_new (type, "name", name, NULL);
  g_hash_table_insert (self->instances, g_steal_pointer (&key), instance);
  moe_mutex_unlock (&self->lock);
  return instance;
}

/**
 * moe_plugin_registry_get_backend:
 * @self: a registry
 * @name: an experts backend name ("eager", "grouped_mm"…)
 * @error: return location for a #GError
 *
 * Opens the backend's module if needed and returns the backend. Errors name
 * what is wrong: an unknown name lists the available ones; a module that
 * cannot be opened, lacks its entry symbol or has another ABI says so.
 *
 * Returns: (transfer none): the backend, or %NULL with @error set
 */
MoeExpertsBackend *
moe_plugin_registry_get_backend (MoePluginRegistry  *self,
                                 const char         *name,
                                 GError            **error)
{
  g_return_val_if_fail (MOE_IS_PLUGIN_REGISTRY (self), NULL);
  g_return_val_if_fail (name != NULL, NULL);

  return (MoeExpertsBackend *) get_instance (self, MOE_PLUGIN_KIND_EXPERTS_BACKEND, name, error);
}

/**
 * moe_plugin_registry_get_device:
 * @self: a registry
 * @name: a device name provided by a plugin ("cuda"…)
 * @error: return location for a #GError
 *
 * Returns: (transfer none): the device, or %NULL with @error set
 */
MoeDevice *
moe_plugin_registry_get_device (MoePluginRegistry  *self,
                                const char         *name,
                                GError            **error)
{
  g_return_val_if_fail (MOE_IS_PLUGIN_REGISTRY (self), NULL);
  g_return_val_if_fail (name != NULL, NULL);

  return (MoeDevice *) get_instance (self, MOE_PLUGIN_KIND_DEVICE, name, error);
}

static GType
list_model_get_item_type (GListModel *model)
{
  return MOE_TYPE_PLUGIN_INFO;
}

static guint
list_model_get_n_items (GListModel *model)
{
  MoePluginRegistry *self = MOE_PLUGIN_REGISTRY (model);
  guint n;

  moe_mutex_lock (&self->lock);
  ensure_scanned_locked (self);
  n = self->plugins->len;
  moe_mutex_unlock (&self->lock);
  return n;
}

static gpointer
list_model_get_item (GListModel *model,
                     guint       position)
{
  MoePluginRegistry *self = MOE_PLUGIN_REGISTRY (model);
  gpointer item = NULL;

  moe_mutex_lock (&self->lock);
  ensure_scanned_locked (self);
  if (position < self->plugins->len)
    item = g_object_ref (g_ptr_array_index (self->plugins, position));
  moe_mutex_unlock (&self->lock);
  return item;
}

static void
list_model_iface_init (GListModelInterface *iface)
{
  iface->get_item_type = list_model_get_item_type;
  iface->get_n_items = list_model_get_n_items;
  iface->get_item = list_model_get_item;
}
