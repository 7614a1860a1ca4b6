/* moe-config.c: a model's config.json and its sub-configs
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#include "config.h"

#include <math.h>
#include <string.h>
#include <json-glib/json-glib.h>

#include "moe-private.h"

/**
 * MoeConfig:
 *
 * A parsed `config.json`. Members that are objects named `*_config`
 * (`text_config`, `vision_config`…, but not `quantization_config`) are
 * sub-configs, available as child configs with [method@Config.get_sub_config].
 *
 * Typed getters report a missing key with %MOE_ERROR_MISSING_KEY and a
 * value of the wrong type with %MOE_ERROR_INVALID_CONFIG; the `_or`
 * variants return a fallback for a missing or null key but still refuse a
 * wrong type.
 */
struct _MoeConfig
{
  GObject     parent_instance;

  char       *name;       /* "" for the top level, else the sub-config key */
  MoeConfig  *parent;     /* weak: the parent owns its children */
  JsonNode   *root;
  GHashTable *children;   /* name -> MoeConfig */
  GPtrArray  *child_names;
};

G_DEFINE_FINAL_TYPE (MoeConfig, moe_config, G_TYPE_OBJECT)

static void
moe_config_finalize (GObject *object)
{
  MoeConfig *self = MOE_CONFIG (object);

  g_free (self->name);
  g_clear_pointer (&self->root, json_node_unref);
  g_clear_pointer (&self->children, g_hash_table_unref);
  g_clear_pointer (&self->child_names, g_ptr_array_unref);

  G_OBJECT_CLASS (moe_config_parent_class)->finalize (object);
}

static void
moe_config_class_init (MoeConfigClass *klass)
{
  G_OBJECT_CLASS (klass)->finalize = moe_config_finalize;
}

static void
moe_config_init (MoeConfig *self)
{
  self->children = g_hash_table_new_full (g_str_hash, g_str_equal, NULL, g_object_unref);
  self->child_names = g_ptr_array_new_with_free_func (g_free);
}

static gboolean
is_sub_config_key (const char *key)
{
  return g_str_has_suffix (key, "_config") &&
         !g_str_equal (key, "quantization_config") &&
         !g_str_equal (key, "generation_config");
}

static MoeConfig *
config_new_for_node (JsonNode   *node,
                     const char *name,
                     MoeConfig  *parent)
{
  MoeConfig *self = g_object_new (MOE_TYPE_CONFIG, NULL);
  JsonObject *obj = json_node_get_object (node);
  g_autoptr(GList) members = json_object_get_members (obj);

  self->name = g_strdup (name);
  self->parent = parent;
  self->root = json_node_ref (node);

  for (GList *l = members; l != NULL; l = l->next)
    {
      const char *key = l->data;
      JsonNode *child = json_object_get_member (obj, key);

      if (is_sub_config_key (key) && JSON_NODE_HOLDS_OBJECT (child))
        {
          MoeConfig *sub = config_new_for_node (child, key, self);
          g_ptr_array_add (self->child_names, g_strdup (key));
          g_hash_table_insert (self->children, sub->name, sub);
        }
    }
  return self;
}

/* json-glib 1.6 accepts `{…} {…}`: it keeps the first value and drops the
 * rest, and its scanner skips C comments and takes '…' strings. A file is
 * taken only when it is one JSON object or array, alone but for whitespace,
 * as Python's json and the safetensors reference take it: text before it
 * (a stray "/", a comment), after it, or an unclosed one is refused here,
 * before json-glib sees it. */
gboolean
_moe_json_is_single_value (const char *data,
                           gsize       length)
{
  gsize i = 0, depth = 0;
  char quote = 0;

  while (i < length && g_ascii_isspace (data[i]))
    i++;
  if (i == length || (data[i] != '{' && data[i] != '['))
    return FALSE;
  for (; i < length; i++)
    {
      char c = data[i];
      if (quote != 0)
        {
          if (c == '\\')
            i++;
          else if (c == quote)
            quote = 0;
        }
      else if (c == '"' || c == '\'')
        quote = c;
      else if (c == '{' || c == '[')
        depth++;
      else if ((c == '}' || c == ']') && --depth == 0)
        break;
    }
  if (i >= length)
    return FALSE;   /* never closed */
  for (i++; i < length; i++)
    if (!g_ascii_isspace (data[i]) && data[i] != '\0')
      return FALSE;
  return TRUE;
}

JsonObject *
_moe_config_get_json_object (MoeConfig *self)
{
  return json_node_get_object (self->root);
}

MoeConfig *
_moe_config_new_for_json (JsonNode   *node,
                          const char *name)
{
  return config_new_for_node (node, name, NULL);
}

/**
 * moe_config_new_from_data:
 * @data: JSON text
 * @length: its length, or -1 if nul-terminated
 * @error: return location for a #GError
 *
 * Returns: (transfer full): the config, or %NULL if @data is not a JSON object
 */
MoeConfig *
moe_config_new_from_data (const char  *data,
                          gssize       length,
                          GError     **error)
{
  g_autoptr(JsonParser) parser = json_parser_new_immutable ();
  g_autoptr(GError) local = NULL;
  JsonNode *root;

  g_return_val_if_fail (data != NULL, NULL);

  /* checked before parsing: json-glib would parse and leak the extra values */
  if (!_moe_json_is_single_value (data, length < 0 ? strlen (data) : (gsize) length))
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_INVALID_CONFIG,
                   "The config is not valid JSON: it must be one JSON object, with nothing before or after it");
      return NULL;
    }
  if (!json_parser_load_from_data (parser, data, length, &local))
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_INVALID_CONFIG,
                   "The config is not valid JSON: %s", local->message);
      return NULL;
    }
  root = json_parser_get_root (parser);
  if (root == NULL || !JSON_NODE_HOLDS_OBJECT (root))
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_INVALID_CONFIG,
                   "The config must be a JSON object");
      return NULL;
    }
  return config_new_for_node (root, "", NULL);
}

/**
 * moe_config_new_from_file:
 * @path: a `config.json`
 * @error: return location for a #GError
 *
 * Returns: (transfer full): the config, or %NULL on error
 */
MoeConfig *
moe_config_new_from_file (const char  *path,
                          GError     **error)
{
  g_autofree char *contents = NULL;
  g_autoptr(GError) local = NULL;
  gsize length;
  MoeConfig *self;

  g_return_val_if_fail (path != NULL, NULL);

  if (!g_file_get_contents (path, &contents, &length, &local))
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_NOT_FOUND, "Could not read %s: %s", path, local->message);
      return NULL;
    }
  self = moe_config_new_from_data (contents, (gssize) length, &local);
  if (self == NULL)
    {
      g_set_error (error, MOE_ERROR, local->code, "%s: %s", path, local->message);
      return NULL;
    }
  return self;
}

/**
 * moe_config_get_name:
 * @self: a config
 *
 * Returns: "" for a top-level config, else its key in the parent ("text_config"…)
 */
const char *
moe_config_get_name (MoeConfig *self)
{
  g_return_val_if_fail (MOE_IS_CONFIG (self), NULL);
  return self->name;
}

/**
 * moe_config_get_parent:
 * @self: a config
 *
 * Returns: (transfer none) (nullable): the config this is a sub-config of
 */
MoeConfig *
moe_config_get_parent (MoeConfig *self)
{
  g_return_val_if_fail (MOE_IS_CONFIG (self), NULL);
  return self->parent;
}

static JsonObject *
object (MoeConfig *self)
{
  return json_node_get_object (self->root);
}

/**
 * moe_config_get_model_type:
 * @self: a config
 *
 * Returns: (nullable): the `model_type` key, if it is a string
 */
const char *
moe_config_get_model_type (MoeConfig *self)
{
  JsonNode *node;

  g_return_val_if_fail (MOE_IS_CONFIG (self), NULL);
  node = json_object_get_member (object (self), "model_type");
  if (node == NULL || json_node_get_value_type (node) != G_TYPE_STRING)
    return NULL;
  return json_node_get_string (node);
}

/**
 * moe_config_list_keys:
 * @self: a config
 *
 * Returns: (transfer full) (array zero-terminated=1): the keys, in file order
 */
char **
moe_config_list_keys (MoeConfig *self)
{
  g_autoptr(GList) members = NULL;
  GPtrArray *keys = g_ptr_array_new ();

  g_return_val_if_fail (MOE_IS_CONFIG (self), NULL);
  members = json_object_get_members (object (self));
  for (GList *l = members; l != NULL; l = l->next)
    g_ptr_array_add (keys, g_strdup (l->data));
  g_ptr_array_add (keys, NULL);
  return (char **) g_ptr_array_free (keys, FALSE);
}

/**
 * moe_config_list_sub_configs:
 * @self: a config
 *
 * Returns: (transfer full) (array zero-terminated=1): the sub-config keys
 */
char **
moe_config_list_sub_configs (MoeConfig *self)
{
  char **out;

  g_return_val_if_fail (MOE_IS_CONFIG (self), NULL);
  out = g_new0 (char *, self->child_names->len + 1);
  for (guint i = 0; i < self->child_names->len; i++)
    out[i] = g_strdup (g_ptr_array_index (self->child_names, i));
  return out;
}

/**
 * moe_config_get_sub_config:
 * @self: a config
 * @name: a sub-config key ("text_config"…)
 *
 * Returns: (transfer none) (nullable): the sub-config
 */
MoeConfig *
moe_config_get_sub_config (MoeConfig  *self,
                           const char *name)
{
  g_return_val_if_fail (MOE_IS_CONFIG (self), NULL);
  g_return_val_if_fail (name != NULL, NULL);
  return g_hash_table_lookup (self->children, name);
}

/**
 * moe_config_has_key:
 * @self: a config
 * @key: a key
 *
 * Returns: %TRUE if the key is present (even if null)
 */
gboolean
moe_config_has_key (MoeConfig  *self,
                    const char *key)
{
  g_return_val_if_fail (MOE_IS_CONFIG (self), FALSE);
  return json_object_has_member (object (self), key);
}

/**
 * moe_config_is_null:
 * @self: a config
 * @key: a key
 *
 * Returns: %TRUE if the key is missing or null
 */
gboolean
moe_config_is_null (MoeConfig  *self,
                    const char *key)
{
  JsonNode *node;

  g_return_val_if_fail (MOE_IS_CONFIG (self), TRUE);
  node = json_object_get_member (object (self), key);
  return node == NULL || JSON_NODE_HOLDS_NULL (node);
}

static const char *
where (MoeConfig *self)
{
  return *self->name ? self->name : "config";
}

/* The member, or NULL; sets MISSING_KEY only when @required. */
static JsonNode *
member (MoeConfig   *self,
        const char  *key,
        gboolean     required,
        GError     **error)
{
  JsonNode *node = json_object_get_member (object (self), key);

  if (node != NULL && !JSON_NODE_HOLDS_NULL (node))
    return node;
  if (required)
    g_set_error (error, MOE_ERROR, MOE_ERROR_MISSING_KEY,
                 "%s: the key “%s” is %s", where (self), key, node ? "null" : "missing");
  return NULL;
}

static void
set_type_error (MoeConfig   *self,
                const char  *key,
                const char  *expected,
                GError     **error)
{
  g_set_error (error, MOE_ERROR, MOE_ERROR_INVALID_CONFIG,
               "%s: the key “%s” must be %s", where (self), key, expected);
}

static gboolean
node_to_int (JsonNode *node,
             gint64   *out)
{
  GType t;

  if (!JSON_NODE_HOLDS_VALUE (node))
    return FALSE;
  t = json_node_get_value_type (node);
  if (t == G_TYPE_INT64)
    {
      *out = json_node_get_int (node);
      return TRUE;
    }
  if (t == G_TYPE_DOUBLE)
    {
      double d = json_node_get_double (node);
      if (d == floor (d) && fabs (d) < 9.007199254740992e15)
        {
          *out = (gint64) d;
          return TRUE;
        }
    }
  return FALSE;
}

static gboolean
lookup_int (MoeConfig   *self,
            const char  *key,
            gboolean     required,
            gint64       fallback,
            gint64      *out,
            GError     **error)
{
  JsonNode *node = member (self, key, required, error);

  *out = fallback;
  if (node == NULL)
    return !required;   /* missing: the fallback, or member ()'s error */
  if (!node_to_int (node, out))
    {
      set_type_error (self, key, "an integer", error);
      return FALSE;
    }
  return TRUE;
}

/**
 * moe_config_get_int:
 * @self: a config
 * @key: a key
 * @error: return location for a #GError
 *
 * Returns: the integer value, or 0 with @error set
 */
gint64
moe_config_get_int (MoeConfig   *self,
                    const char  *key,
                    GError     **error)
{
  gint64 v;

  g_return_val_if_fail (MOE_IS_CONFIG (self), 0);
  return lookup_int (self, key, TRUE, 0, &v, error) ? v : 0;
}

/**
 * moe_config_get_int_or:
 * @self: a config
 * @key: a key
 * @fallback: the value for a missing or null key
 * @error: return location for a #GError
 *
 * Returns: the integer value, @fallback, or @fallback with @error set if
 *   the value is not an integer
 */
gint64
moe_config_get_int_or (MoeConfig   *self,
                       const char  *key,
                       gint64       fallback,
                       GError     **error)
{
  gint64 v;

  g_return_val_if_fail (MOE_IS_CONFIG (self), fallback);
  return lookup_int (self, key, FALSE, fallback, &v, error) ? v : fallback;
}

static gboolean
lookup_double (MoeConfig   *self,
               const char  *key,
               gboolean     required,
               double       fallback,
               double      *out,
               GError     **error)
{
  JsonNode *node = member (self, key, required, error);
  GType t;

  *out = fallback;
  if (node == NULL)
    return !required;   /* missing: the fallback, or member ()'s error */
  t = JSON_NODE_HOLDS_VALUE (node) ? json_node_get_value_type (node) : G_TYPE_INVALID;
  if (t == G_TYPE_DOUBLE || t == G_TYPE_INT64)
    {
      *out = json_node_get_double (node);
      return TRUE;
    }
  set_type_error (self, key, "a number", error);
  return FALSE;
}

/**
 * moe_config_get_double:
 * @self: a config
 * @key: a key
 * @error: return location for a #GError
 *
 * Returns: the numeric value, or 0 with @error set
 */
double
moe_config_get_double (MoeConfig   *self,
                       const char  *key,
                       GError     **error)
{
  double v;

  g_return_val_if_fail (MOE_IS_CONFIG (self), 0);
  return lookup_double (self, key, TRUE, 0, &v, error) ? v : 0;
}

/**
 * moe_config_get_double_or:
 * @self: a config
 * @key: a key
 * @fallback: the value for a missing or null key
 * @error: return location for a #GError
 *
 * Returns: the numeric value or @fallback
 */
double
moe_config_get_double_or (MoeConfig   *self,
                          const char  *key,
                          double       fallback,
                          GError     **error)
{
  double v;

  g_return_val_if_fail (MOE_IS_CONFIG (self), fallback);
  return lookup_double (self, key, FALSE, fallback, &v, error) ? v : fallback;
}

static gboolean
lookup_boolean (MoeConfig   *self,
                const char  *key,
                gboolean     required,
                gboolean     fallback,
                gboolean    *out,
                GError     **error)
{
  JsonNode *node = member (self, key, required, error);

  *out = fallback;
  if (node == NULL)
    return !required;   /* missing: the fallback, or member ()'s error */
  if (JSON_NODE_HOLDS_VALUE (node) && json_node_get_value_type (node) == G_TYPE_BOOLEAN)
    {
      *out = json_node_get_boolean (node);
      return TRUE;
    }
  set_type_error (self, key, "true or false", error);
  return FALSE;
}

/**
 * moe_config_get_boolean:
 * @self: a config
 * @key: a key
 * @error: return location for a #GError
 *
 * Returns: the boolean value, or %FALSE with @error set
 */
gboolean
moe_config_get_boolean (MoeConfig   *self,
                        const char  *key,
                        GError     **error)
{
  gboolean v;

  g_return_val_if_fail (MOE_IS_CONFIG (self), FALSE);
  return lookup_boolean (self, key, TRUE, FALSE, &v, error) ? v : FALSE;
}

/**
 * moe_config_get_boolean_or:
 * @self: a config
 * @key: a key
 * @fallback: the value for a missing or null key
 * @error: return location for a #GError
 *
 * Returns: the boolean value or @fallback
 */
gboolean
moe_config_get_boolean_or (MoeConfig   *self,
                           const char  *key,
                           gboolean     fallback,
                           GError     **error)
{
  gboolean v;

  g_return_val_if_fail (MOE_IS_CONFIG (self), fallback);
  return lookup_boolean (self, key, FALSE, fallback, &v, error) ? v : fallback;
}

static char *
lookup_string (MoeConfig   *self,
               const char  *key,
               gboolean     required,
               const char  *fallback,
               GError     **error)
{
  JsonNode *node = member (self, key, required, error);

  if (node == NULL)
    return required ? NULL : g_strdup (fallback);   /* member () set the error */
  if (JSON_NODE_HOLDS_VALUE (node) && json_node_get_value_type (node) == G_TYPE_STRING)
    return g_strdup (json_node_get_string (node));
  set_type_error (self, key, "a string", error);
  return NULL;
}

/**
 * moe_config_dup_string:
 * @self: a config
 * @key: a key
 * @error: return location for a #GError
 *
 * Returns: (transfer full): the string value, or %NULL with @error set
 */
char *
moe_config_dup_string (MoeConfig   *self,
                       const char  *key,
                       GError     **error)
{
  g_return_val_if_fail (MOE_IS_CONFIG (self), NULL);
  return lookup_string (self, key, TRUE, NULL, error);
}

/**
 * moe_config_dup_string_or:
 * @self: a config
 * @key: a key
 * @fallback: (nullable): the value for a missing or null key
 * @error: return location for a #GError
 *
 * Returns: (transfer full) (nullable): the string value or a copy of @fallback
 */
char *
moe_config_dup_string_or (MoeConfig   *self,
                          const char  *key,
                          const char  *fallback,
                          GError     **error)
{
  g_return_val_if_fail (MOE_IS_CONFIG (self), NULL);
  return lookup_string (self, key, FALSE, fallback, error);
}

/**
 * moe_config_get_int_array:
 * @self: a config
 * @key: a key holding an array of integers
 * @error: return location for a #GError
 *
 * Returns: (transfer full) (element-type gint64): the integers; an empty
 *   array if the key is missing or null; %NULL with @error set if it is
 *   not an array of integers
 */
GArray *
moe_config_get_int_array (MoeConfig   *self,
                          const char  *key,
                          GError     **error)
{
  g_autoptr(GArray) out = g_array_new (FALSE, FALSE, sizeof (gint64));
  JsonNode *node;
  JsonArray *array;

  g_return_val_if_fail (MOE_IS_CONFIG (self), NULL);

  node = member (self, key, FALSE, NULL);
  if (node == NULL)
    return g_steal_pointer (&out);
  if (!JSON_NODE_HOLDS_ARRAY (node))
    {
      set_type_error (self, key, "an array of integers", error);
      return NULL;
    }
  array = json_node_get_array (node);
  for (guint i = 0; i < json_array_get_length (array); i++)
    {
      gint64 v;
      if (!node_to_int (json_array_get_element (array, i), &v))
        {
          set_type_error (self, key, "an array of integers", error);
          return NULL;
        }
      g_array_append_val (out, v);
    }
  return g_steal_pointer (&out);
}

/**
 * moe_config_to_string:
 * @self: a config
 *
 * Returns: (transfer full): the config as JSON text
 */
char *
moe_config_to_string (MoeConfig *self)
{
  g_return_val_if_fail (MOE_IS_CONFIG (self), NULL);
  return json_to_string (self->root, TRUE);
}

/* An object member that is not a sub-config ("quantization_config") as a
 * config of its own; %NULL when absent or not an object. */
MoeConfig *
_moe_config_dup_object (MoeConfig  *self,
                        const char *key)
{
  JsonObject *obj = json_node_get_object (self->root);
  JsonNode *child = json_object_get_member (obj, key);

  if (child == NULL || !JSON_NODE_HOLDS_OBJECT (child))
    return NULL;
  return config_new_for_node (child, key, self);
}
