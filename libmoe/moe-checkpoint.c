/* moe-checkpoint.c: Hugging Face safetensors checkpoints, memory-mapped
 *
 * SPDX-License-Identifier: LGPL-2.1-or-later
 */
#include "config.h"

#include <stdlib.h>
#include <string.h>
#include <json-glib/json-glib.h>

#include "moe-private.h"

/**
 * MoeCheckpoint:
 *
 * A safetensors checkpoint: one `.safetensors` file, or a directory with
 * `model.safetensors` or a sharded `model.safetensors.index.json`. Files are
 * memory-mapped and tensors wrap the mapping without copying.
 *
 * Every header is checked before use: its length against the file, each
 * tensor's dtype, shape × dtype size against its byte range, its range
 * against the data section, and ranges against each other (no overlap).
 */

/* A header larger than this is refused rather than parsed. */
#define MAX_HEADER_SIZE (100 * 1024 * 1024)

typedef struct
{
  char        *path;
  GMappedFile *mapped;
  GBytes      *bytes;
  gsize        data_start;
} Shard;

typedef struct
{
  char     *name;
  MoeDType  dtype;
  guint     n_dims;
  gint64    shape[MOE_TENSOR_MAX_DIMS];
  gsize     begin;
  gsize     end;
  Shard    *shard;
} Entry;

struct _MoeCheckpoint
{
  GObject     parent_instance;

  char       *path;
  GPtrArray  *shards;     /* Shard* */
  GHashTable *entries;    /* name -> Entry* */
  GHashTable *metadata;   /* utf8 -> utf8 */
};

G_DEFINE_FINAL_TYPE (MoeCheckpoint, moe_checkpoint, G_TYPE_OBJECT)

static void
shard_free (gpointer p)
{
  Shard *s = p;

  g_free (s->path);
  g_clear_pointer (&s->bytes, g_bytes_unref);
  g_clear_pointer (&s->mapped, g_mapped_file_unref);
  g_free (s);
}

static void
entry_free (gpointer p)
{
  Entry *e = p;

  g_free (e->name);
  g_free (e);
}

static void
moe_checkpoint_finalize (GObject *object)
{
  MoeCheckpoint *self = MOE_CHECKPOINT (object);

  g_free (self->path);
  g_hash_table_unref (self->entries);
  g_ptr_array_unref (self->shards);
  g_hash_table_unref (self->metadata);

  G_OBJECT_CLASS (moe_checkpoint_parent_class)->finalize (object);
}

static void
moe_checkpoint_class_init (MoeCheckpointClass *klass)
{
  G_OBJECT_CLASS (klass)->finalize = moe_checkpoint_finalize;
}

static void
moe_checkpoint_init (MoeCheckpoint *self)
{
  self->shards = g_ptr_array_new_with_free_func (shard_free);
  self->entries = g_hash_table_new_full (g_str_hash, g_str_equal, NULL, entry_free);
  self->metadata = g_hash_table_new_full (g_str_hash, g_str_equal, g_free, g_free);
}

static JsonParser *new_parser (GHashTable **seen);

static gboolean
bad (GError     **error,
     const char  *path,
     const char  *format,
     ...) G_GNUC_PRINTF (3, 4);

static gboolean
bad (GError     **error,
     const char  *path,
     const char  *format,
     ...)
{
  g_autofree char *msg = NULL;
  va_list args;

  va_start (args, format);
  msg = g_strdup_vprintf (format, args);
  va_end (args);
  g_set_error (error, MOE_ERROR, MOE_ERROR_INVALID_CHECKPOINT, "%s: %s", path, msg);
  return FALSE;
}

static gboolean
json_to_offset (JsonNode *node,
                gint64   *out)
{
  if (!JSON_NODE_HOLDS_VALUE (node) || json_node_get_value_type (node) != G_TYPE_INT64)
    return FALSE;
  *out = json_node_get_int (node);
  return *out >= 0;
}

static gboolean
parse_entry (MoeCheckpoint  *self,
             Shard          *shard,
             const char     *name,
             JsonNode       *node,
             gsize           data_size,
             GPtrArray      *in_shard,
             GError        **error)
{
  const char *path = shard->path;
  JsonObject *obj;
  JsonNode *dtype_node, *shape_node, *offsets_node;
  JsonArray *shape, *offsets;
  g_autofree Entry *entry = NULL;
  gint64 n, begin, end;

  if (!g_utf8_validate (name, -1, NULL))
    return bad (error, path, "a tensor name is not valid UTF-8");
  if (!JSON_NODE_HOLDS_OBJECT (node))
    return bad (error, path, "tensor “%s”: its header entry is not an object", name);
  obj = json_node_get_object (node);
  dtype_node = json_object_get_member (obj, "dtype");
  shape_node = json_object_get_member (obj, "shape");
  offsets_node = json_object_get_member (obj, "data_offsets");
  if (dtype_node == NULL || shape_node == NULL || offsets_node == NULL)
    return bad (error, path, "tensor “%s”: needs dtype, shape and data_offsets", name);

  entry = g_new0 (Entry, 1);
  if (!JSON_NODE_HOLDS_VALUE (dtype_node) || json_node_get_value_type (dtype_node) != G_TYPE_STRING ||
      !moe_dtype_from_name (json_node_get_string (dtype_node), &entry->dtype) ||
      !g_ascii_isupper (json_node_get_string (dtype_node)[0]))
    return bad (error, path,
                "tensor “%s”: unknown dtype; valid: F64, F32, F16, BF16, F8_E4M3, F8_E8M0, I64, I32, I16, I8, U8, BOOL",
                name);

  if (!JSON_NODE_HOLDS_ARRAY (shape_node))
    return bad (error, path, "tensor “%s”: shape is not an array", name);
  shape = json_node_get_array (shape_node);
  if (json_array_get_length (shape) > MOE_TENSOR_MAX_DIMS)
    return bad (error, path, "tensor “%s”: more than %d dimensions", name, MOE_TENSOR_MAX_DIMS);
  entry->n_dims = json_array_get_length (shape);
  for (guint i = 0; i < entry->n_dims; i++)
    if (!json_to_offset (json_array_get_element (shape, i), &entry->shape[i]))
      return bad (error, path, "tensor “%s”: shape entries must be non-negative integers", name);
  if (!_moe_shape_n_elements (entry->shape, entry->n_dims, &n, NULL))
    return bad (error, path, "tensor “%s”: the shape's element count overflows", name);

  if (!JSON_NODE_HOLDS_ARRAY (offsets_node) ||
      json_array_get_length (offsets = json_node_get_array (offsets_node)) != 2 ||
      !json_to_offset (json_array_get_element (offsets, 0), &begin) ||
      !json_to_offset (json_array_get_element (offsets, 1), &end))
    return bad (error, path, "tensor “%s”: data_offsets must be two non-negative integers", name);
  if (begin > end || (guint64) end > data_size)
    return bad (error, path,
                "tensor “%s”: data_offsets [%" G_GINT64_FORMAT ", %" G_GINT64_FORMAT
                "] fall outside the %" G_GSIZE_FORMAT "-byte data section",
                name, begin, end, data_size);
  if (end - begin != n * (gint64) moe_dtype_get_size (entry->dtype))
    return bad (error, path,
                "tensor “%s”: %" G_GINT64_FORMAT " elements of %s need %" G_GINT64_FORMAT
                " bytes but data_offsets span %" G_GINT64_FORMAT,
                name, n, moe_dtype_get_name (entry->dtype),
                n * (gint64) moe_dtype_get_size (entry->dtype), end - begin);
  if (g_hash_table_contains (self->entries, name))
    return bad (error, path, "tensor “%s” appears twice", name);

  entry->name = g_strdup (name);
  entry->begin = (gsize) begin;
  entry->end = (gsize) end;
  entry->shard = shard;
  g_ptr_array_add (in_shard, entry);
  g_hash_table_insert (self->entries, entry->name, entry);
  g_steal_pointer (&entry);
  return TRUE;
}

static int
compare_begin (gconstpointer a,
               gconstpointer b)
{
  const Entry *x = *(Entry * const *) a, *y = *(Entry * const *) b;

  return x->begin < y->begin ? -1 : x->begin > y->begin ? 1 : 0;
}

static Shard *
open_shard (MoeCheckpoint  *self,
            const char     *path,
            GError        **error)
{
  g_autoptr(GError) local = NULL;
  g_autoptr(JsonParser) parser = NULL;
  g_autoptr(GHashTable) seen = NULL;
  g_autoptr(GPtrArray) in_shard = g_ptr_array_new ();
  g_autoptr(GList) members = NULL;
  Shard *shard;
  const guint8 *data;
  gsize size, data_size;
  guint64 header_len = 0;
  JsonNode *root;
  JsonObject *header;

  shard = g_new0 (Shard, 1);
  shard->path = g_strdup (path);
  g_ptr_array_add (self->shards, shard);   /* freed with the checkpoint */

  shard->mapped = g_mapped_file_new (path, FALSE, &local);
  if (shard->mapped == NULL)
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_NOT_FOUND, "Could not open %s: %s", path, local->message);
      return NULL;
    }
  shard->bytes = g_mapped_file_get_bytes (shard->mapped);
  data = g_bytes_get_data (shard->bytes, &size);

  if (size < 8)
    return bad (error, path, "%" G_GSIZE_FORMAT " bytes is too short for a safetensors file (the header length alone is 8)", size), NULL;
  for (int i = 7; i >= 0; i--)
    header_len = (header_len << 8) | data[i];
  if (header_len > size - 8)
    return bad (error, path, "the header length %" G_GUINT64_FORMAT " runs past the end of the file (%" G_GSIZE_FORMAT " bytes)",
                header_len, size), NULL;
  if (header_len > MAX_HEADER_SIZE)
    return bad (error, path, "the header is %" G_GUINT64_FORMAT " bytes; at most %d are accepted",
                header_len, MAX_HEADER_SIZE), NULL;
  if (header_len < 2)
    return bad (error, path, "the header is empty"), NULL;

  shard->data_start = 8 + header_len;
  data_size = size - shard->data_start;

  /* checked before parsing: json-glib would parse and leak the extra values */
  if (!_moe_json_is_single_value ((const char *) data + 8, header_len))
    return bad (error, path, "the header is not valid JSON: it must be one JSON object, with nothing before or after it"), NULL;
  parser = new_parser (&seen);
  if (!json_parser_load_from_data (parser, (const char *) data + 8, (gssize) header_len, &local))
    return bad (error, path, "the header is not valid JSON: %s", local->message), NULL;
  if (g_object_get_data (G_OBJECT (parser), "moe-duplicate") != NULL)
    return bad (error, path, "the header names “%s” twice",
                (const char *) g_object_get_data (G_OBJECT (parser), "moe-duplicate")), NULL;
  root = json_parser_get_root (parser);
  if (root == NULL || !JSON_NODE_HOLDS_OBJECT (root))
    return bad (error, path, "the header is not a JSON object"), NULL;
  header = json_node_get_object (root);

  members = json_object_get_members (header);
  for (GList *l = members; l != NULL; l = l->next)
    {
      const char *name = l->data;
      JsonNode *node = json_object_get_member (header, name);

      if (g_str_equal (name, "__metadata__"))
        {
          JsonObject *meta;
          g_autoptr(GList) keys = NULL;

          if (!JSON_NODE_HOLDS_OBJECT (node))
            return bad (error, path, "__metadata__ is not an object"), NULL;
          meta = json_node_get_object (node);
          keys = json_object_get_members (meta);
          for (GList *k = keys; k != NULL; k = k->next)
            {
              JsonNode *v = json_object_get_member (meta, k->data);
              if (!JSON_NODE_HOLDS_VALUE (v) || json_node_get_value_type (v) != G_TYPE_STRING)
                return bad (error, path, "__metadata__ value “%s” is not a string", (char *) k->data), NULL;
              g_hash_table_replace (self->metadata, g_strdup (k->data), g_strdup (json_node_get_string (v)));
            }
          continue;
        }
      if (!parse_entry (self, shard, name, node, data_size, in_shard, error))
        return NULL;
    }

  g_ptr_array_sort (in_shard, compare_begin);
  for (guint i = 1; i < in_shard->len; i++)
    {
      Entry *prev = g_ptr_array_index (in_shard, i - 1);
      Entry *cur = g_ptr_array_index (in_shard, i);
      if (cur->begin < prev->end && cur->begin != cur->end)
        return bad (error, path, "tensors “%s” and “%s” overlap", prev->name, cur->name), NULL;
    }
  return shard;
}

/* json-glib keeps the last of duplicated members silently; a checkpoint
 * with a name twice is ambiguous, so duplicates are counted as parsed. */
static void
on_object_member (JsonParser *parser,
                  JsonObject *object,
                  const char *name,
                  gpointer    data)
{
  GHashTable *seen = data;
  char *key = g_strdup_printf ("%p/%s", (gpointer) object, name);

  if (!g_hash_table_add (seen, key))
    g_object_set_data_full (G_OBJECT (parser), "moe-duplicate", g_strdup (name), g_free);
}

static JsonParser *
new_parser (GHashTable **seen)
{
  JsonParser *parser = json_parser_new_immutable ();

  *seen = g_hash_table_new_full (g_str_hash, g_str_equal, g_free, NULL);
  g_signal_connect (parser, "object-member", G_CALLBACK (on_object_member), *seen);
  return parser;
}

static gboolean
is_plain_file_name (const char *name)
{
  return *name != '\0' && strchr (name, '/') == NULL && strchr (name, '\\') == NULL &&
         !g_str_equal (name, ".") && !g_str_equal (name, "..");
}

static gboolean
open_index (MoeCheckpoint  *self,
            const char     *dir,
            const char     *index_path,
            GError        **error)
{
  g_autoptr(GHashTable) seen = NULL;
  g_autoptr(JsonParser) parser = new_parser (&seen);
  g_autoptr(GError) local = NULL;
  g_autoptr(GHashTable) opened = g_hash_table_new (g_str_hash, g_str_equal);
  g_autoptr(GList) names = NULL;
  JsonNode *root, *map_node;
  JsonObject *map;

  {
    g_autoptr(GMappedFile) mapped = g_mapped_file_new (index_path, FALSE, &local);
    if (mapped == NULL)
      return bad (error, index_path, "cannot be read: %s", local->message);
    if (g_mapped_file_get_length (mapped) == 0)
      return bad (error, index_path, "is empty");
    if (!_moe_json_is_single_value (g_mapped_file_get_contents (mapped), g_mapped_file_get_length (mapped)))
      return bad (error, index_path, "is not valid JSON: it must be one JSON object, with nothing before or after it");
    if (!json_parser_load_from_data (parser, g_mapped_file_get_contents (mapped),
                                     (gssize) g_mapped_file_get_length (mapped), &local))
      return bad (error, index_path, "not valid JSON: %s", local->message);
  }
  if (g_object_get_data (G_OBJECT (parser), "moe-duplicate") != NULL)
    return bad (error, index_path, "“%s” appears twice",
                (const char *) g_object_get_data (G_OBJECT (parser), "moe-duplicate"));
  root = json_parser_get_root (parser);
  if (root == NULL || !JSON_NODE_HOLDS_OBJECT (root) ||
      (map_node = json_object_get_member (json_node_get_object (root), "weight_map")) == NULL ||
      !JSON_NODE_HOLDS_OBJECT (map_node))
    return bad (error, index_path, "needs a \"weight_map\" object");
  map = json_node_get_object (map_node);

  names = json_object_get_members (map);
  for (GList *l = names; l != NULL; l = l->next)
    {
      JsonNode *v = json_object_get_member (map, l->data);
      const char *file;
      g_autofree char *shard_path = NULL;

      if (!JSON_NODE_HOLDS_VALUE (v) || json_node_get_value_type (v) != G_TYPE_STRING)
        return bad (error, index_path, "weight_map entry “%s” is not a file name", (char *) l->data);
      file = json_node_get_string (v);
      if (!is_plain_file_name (file))
        return bad (error, index_path, "shard “%s” is not a plain file name in the checkpoint directory", file);
      if (g_hash_table_contains (opened, file))
        continue;
      shard_path = g_build_filename (dir, file, NULL);
      if (!g_file_test (shard_path, G_FILE_TEST_IS_REGULAR))
        return bad (error, index_path, "the shard %s it names is missing", file);
      if (!_moe_checkpoint_check_file (dir, file, error))
        return FALSE;
      if (open_shard (self, shard_path, error) == NULL)
        return FALSE;
      g_hash_table_add (opened, (gpointer) file);
    }
  for (GList *l = names; l != NULL; l = l->next)
    if (!g_hash_table_contains (self->entries, l->data))
      return bad (error, index_path, "tensor “%s” is not in its shard %s", (char *) l->data,
                  json_object_get_string_member (map, l->data));
  return TRUE;
}

static gboolean
is_within (const char *path,
           const char *dir)
{
  gsize n = strlen (dir);

  return strncmp (path, dir, n) == 0 && (path[n] == '/' || path[n] == '\0');
}

/* The symbolic-link policy for the files of a checkpoint directory: a file
 * may be a link only to a file inside the directory, or — the Hugging Face
 * cache layout, <repo>/snapshots/<revision>/<file> → <repo>/blobs/<hash> —
 * inside its repository's blobs/ directory. Anything else is refused, so a
 * checkpoint cannot make libmoe read files elsewhere on the system. */
gboolean
_moe_checkpoint_check_file (const char  *dir,
                            const char  *name,
                            GError     **error)
{
  g_autofree char *path = g_build_filename (dir, name, NULL);
  g_autofree char *real_dir = realpath (dir, NULL);
  g_autofree char *real = NULL;
  g_autofree char *blobs = NULL;

  if (!g_file_test (path, G_FILE_TEST_IS_SYMLINK))
    return TRUE;
  real = realpath (path, NULL);
  if (real != NULL && real_dir != NULL)
    {
      g_autofree char *snapshots = g_path_get_dirname (real_dir);
      g_autofree char *repo = g_path_get_dirname (snapshots);
      g_autofree char *base = g_path_get_basename (snapshots);
      if (is_within (real, real_dir))
        return TRUE;
      if (g_str_equal (base, "snapshots"))
        {
          blobs = g_build_filename (repo, "blobs", NULL);
          if (is_within (real, blobs))
            return TRUE;
        }
    }
  g_set_error (error, MOE_ERROR, MOE_ERROR_INVALID_CHECKPOINT,
               "%s is a symbolic link to %s, outside the checkpoint directory; links may only point "
               "inside it (or, in a Hugging Face cache, into the repository's blobs/)",
               path, real ? real : "a missing file");
  return FALSE;
}

/**
 * moe_checkpoint_open:
 * @path: a `.safetensors` file or a checkpoint directory
 * @error: return location for a #GError
 *
 * Opens a checkpoint and checks its headers.
 *
 * Returns: (transfer full): the checkpoint, or %NULL with
 *   %MOE_ERROR_INVALID_CHECKPOINT or %MOE_ERROR_NOT_FOUND
 */
MoeCheckpoint *
moe_checkpoint_open (const char  *path,
                     GError     **error)
{
  g_autoptr(MoeCheckpoint) self = NULL;

  g_return_val_if_fail (path != NULL, NULL);

  self = g_object_new (MOE_TYPE_CHECKPOINT, NULL);
  self->path = g_strdup (path);

  if (g_file_test (path, G_FILE_TEST_IS_DIR))
    {
      g_autofree char *index = g_build_filename (path, "model.safetensors.index.json", NULL);
      g_autofree char *single = g_build_filename (path, "model.safetensors", NULL);

      if (g_file_test (index, G_FILE_TEST_IS_REGULAR))
        {
          if (!_moe_checkpoint_check_file (path, "model.safetensors.index.json", error) ||
              !open_index (self, path, index, error))
            return NULL;
        }
      else if (g_file_test (single, G_FILE_TEST_IS_REGULAR))
        {
          if (!_moe_checkpoint_check_file (path, "model.safetensors", error) ||
              open_shard (self, single, error) == NULL)
            return NULL;
        }
      else
        {
          g_set_error (error, MOE_ERROR, MOE_ERROR_NOT_FOUND,
                       "%s holds neither model.safetensors nor model.safetensors.index.json", path);
          return NULL;
        }
    }
  else if (open_shard (self, path, error) == NULL)
    return NULL;

  return g_steal_pointer (&self);
}

/**
 * moe_checkpoint_get_path:
 * @self: a checkpoint
 *
 * Returns: the path it was opened from
 */
const char *
moe_checkpoint_get_path (MoeCheckpoint *self)
{
  g_return_val_if_fail (MOE_IS_CHECKPOINT (self), NULL);
  return self->path;
}

static int
compare_strings (gconstpointer a,
                 gconstpointer b)
{
  return strcmp (*(const char * const *) a, *(const char * const *) b);
}

/**
 * moe_checkpoint_list_tensors:
 * @self: a checkpoint
 *
 * Returns: (transfer full) (array zero-terminated=1): the tensor names, sorted
 */
char **
moe_checkpoint_list_tensors (MoeCheckpoint *self)
{
  GPtrArray *names = g_ptr_array_new ();
  GHashTableIter iter;
  gpointer key;

  g_return_val_if_fail (MOE_IS_CHECKPOINT (self), NULL);

  g_hash_table_iter_init (&iter, self->entries);
  while (g_hash_table_iter_next (&iter, &key, NULL))
    g_ptr_array_add (names, g_strdup (key));
  g_ptr_array_sort (names, compare_strings);
  g_ptr_array_add (names, NULL);
  return (char **) g_ptr_array_free (names, FALSE);
}

/**
 * moe_checkpoint_has_tensor:
 * @self: a checkpoint
 * @name: a tensor name
 *
 * Returns: %TRUE if the checkpoint holds @name
 */
gboolean
moe_checkpoint_has_tensor (MoeCheckpoint *self,
                           const char    *name)
{
  g_return_val_if_fail (MOE_IS_CHECKPOINT (self), FALSE);
  return g_hash_table_contains (self->entries, name);
}

static Entry *
lookup (MoeCheckpoint  *self,
        const char     *name,
        GError        **error)
{
  Entry *e = g_hash_table_lookup (self->entries, name);

  if (e == NULL)
    g_set_error (error, MOE_ERROR, MOE_ERROR_NOT_FOUND,
                 "%s has no tensor “%s”", self->path, name);
  return e;
}

/**
 * moe_checkpoint_get_tensor:
 * @self: a checkpoint
 * @name: a tensor name
 * @error: return location for a #GError
 *
 * Returns: (transfer full): the tensor, a view of the mapped file, or
 *   %NULL with %MOE_ERROR_NOT_FOUND
 */
MoeTensor *
moe_checkpoint_get_tensor (MoeCheckpoint  *self,
                           const char     *name,
                           GError        **error)
{
  g_autoptr(GBytes) bytes = NULL;
  Entry *e;

  g_return_val_if_fail (MOE_IS_CHECKPOINT (self), NULL);
  g_return_val_if_fail (name != NULL, NULL);

  e = lookup (self, name, error);
  if (e == NULL)
    return NULL;
  bytes = g_bytes_new_from_bytes (e->shard->bytes, e->shard->data_start + e->begin, e->end - e->begin);
  return moe_tensor_new_from_bytes (e->dtype, e->shape, e->n_dims, bytes, error);
}

/**
 * moe_checkpoint_get_tensor_info:
 * @self: a checkpoint
 * @name: a tensor name
 * @dtype: (out) (optional): the dtype
 * @shape: (out) (optional) (transfer full) (element-type gint64): the dimensions
 * @error: return location for a #GError
 *
 * Reads a tensor's header entry without touching its data.
 *
 * Returns: %TRUE if the tensor exists
 */
gboolean
moe_checkpoint_get_tensor_info (MoeCheckpoint  *self,
                                const char     *name,
                                MoeDType       *dtype,
                                GArray        **shape,
                                GError        **error)
{
  Entry *e;

  g_return_val_if_fail (MOE_IS_CHECKPOINT (self), FALSE);

  e = lookup (self, name, error);
  if (e == NULL)
    return FALSE;
  if (dtype != NULL)
    *dtype = e->dtype;
  if (shape != NULL)
    {
      *shape = g_array_sized_new (FALSE, FALSE, sizeof (gint64), e->n_dims);
      g_array_append_vals (*shape, e->shape, e->n_dims);
    }
  return TRUE;
}

/**
 * moe_checkpoint_get_metadata:
 * @self: a checkpoint
 *
 * Returns: (transfer none) (element-type utf8 utf8): the `__metadata__`
 *   strings of all its files
 */
GHashTable *
moe_checkpoint_get_metadata (MoeCheckpoint *self)
{
  g_return_val_if_fail (MOE_IS_CHECKPOINT (self), NULL);
  return self->metadata;
}

/**
 * moe_checkpoint_get_metadata_value:
 * @self: a checkpoint
 * @key: a `__metadata__` key
 *
 * Returns: (nullable): its value
 */
const char *
moe_checkpoint_get_metadata_value (MoeCheckpoint *self,
                                   const char    *key)
{
  g_return_val_if_fail (MOE_IS_CHECKPOINT (self), NULL);
  return g_hash_table_lookup (self->metadata, key);
}

/* Stacks per-expert 2-D tensors `prefix.N.<names[0]>` (and, when @n_names
 * is 2, concatenates `prefix.N.<names[1]>` after it along the rows), in
 * numeric expert order: transformers' MergeModulelist + Concatenate. */
static MoeTensor *
fuse_experts (MoeCheckpoint  *self,
              const char     *prefix,
              guint           n_experts,
              const char    **names,
              guint           n_names,
              GError        **error)
{
  g_autoptr(MoeTensor) out = NULL;
  MoeDType dtype = MOE_DTYPE_F32;
  gint64 rows = 0, cols = 0, total_rows = 0;
  guint8 *dst;
  gsize elt;

  for (guint e = 0; e < n_experts; e++)
    {
      gint64 r = 0;
      for (guint i = 0; i < n_names; i++)
        {
          g_autofree char *key = g_strdup_printf ("%s.%u.%s", prefix, e, names[i]);
          Entry *t = lookup (self, key, error);
          if (t == NULL)
            return NULL;
          if (t->n_dims != 2 || (e + i > 0 && (t->dtype != dtype || t->shape[1] != cols)))
            return bad (error, self->path, "expert tensor “%s” does not match the others (dtype and columns must agree)", key), NULL;
          dtype = t->dtype;
          cols = t->shape[1];
          r += t->shape[0];
        }
      if (e > 0 && r != rows)
        return bad (error, self->path, "expert %u of %s has %" G_GINT64_FORMAT " rows, expert 0 has %" G_GINT64_FORMAT,
                    e, prefix, r, rows), NULL;
      rows = r;
    }
  total_rows = rows;

  {
    gint64 shape[3] = { n_experts, total_rows, cols };
    out = moe_tensor_new_empty (NULL, dtype, shape, 3, error);
    if (out == NULL)
      return NULL;
  }
  elt = moe_dtype_get_size (dtype);
  dst = moe_tensor_get_mutable_data (out);
  /* a layer's experts are often a GB of fresh memory: its page faults in
   * parallel, then the copies */
  moe_cpu_fault_in (dst, moe_tensor_get_n_bytes (out));
  for (guint e = 0; e < n_experts; e++)
    for (guint i = 0; i < n_names; i++)
      {
        g_autofree char *key = g_strdup_printf ("%s.%u.%s", prefix, e, names[i]);
        Entry *t = g_hash_table_lookup (self->entries, key);
        gsize n = t->end - t->begin;
        memcpy (dst, (const guint8 *) g_bytes_get_data (t->shard->bytes, NULL) + t->shard->data_start + t->begin, n);
        dst += n;
      }
  g_assert (dst == (guint8 *) moe_tensor_get_mutable_data (out) + n_experts * total_rows * cols * elt);
  return g_steal_pointer (&out);
}

static guint
count_experts (MoeCheckpoint *self,
               const char    *prefix,
               const char    *suffix)
{
  guint n = 0;

  for (;; n++)
    {
      g_autofree char *key = g_strdup_printf ("%s.%u.%s", prefix, n, suffix);
      if (!g_hash_table_contains (self->entries, key))
        return n;
    }
}

gboolean
_moe_fused_experts_transposed (const gint64 *u,
                               const gint64 *d)
{
  /* by the pair: with H = 2I gate_up alone is square either way */
  return !(u[1] == 2 * d[2] && u[2] == d[1]) && (u[2] == 2 * d[1] && u[1] == d[2]);
}

/**
 * moe_checkpoint_load_experts:
 * @self: a checkpoint
 * @prefix: the experts module's key prefix, such as
 *   `model.layers.0.mlp.experts`
 * @error: return location for a #GError
 *
 * Builds one layer's [class@Experts] the way transformers' loader does:
 *
 * - per-expert keys `prefix.N.gate_proj/up_proj/down_proj.weight` (or
 *   Mixtral's `w1/w3/w2`) are stacked by numeric expert index, with gate
 *   rows before up rows in `gate_up`;
 * - already-fused `prefix.gate_up_proj` and `prefix.down_proj` (with
 *   optional `_bias` tensors) are used in place; when the shapes only fit
 *   the transposed layout, `is-transposed` is set.
 *
 * Returns: (transfer full): the experts, or %NULL with @error set
 */
MoeExperts *
moe_checkpoint_load_experts (MoeCheckpoint  *self,
                             const char     *prefix,
                             GError        **error)
{
  g_autofree char *fused = NULL;
  g_autoptr(MoeTensor) up = NULL;
  g_autoptr(MoeTensor) down = NULL;
  MoeExperts *experts;
  static const char *qwen_up[] = { "gate_proj.weight", "up_proj.weight" };
  static const char *qwen_down[] = { "down_proj.weight" };
  static const char *qwen_up_scale[] = { "gate_proj.weight_scale_inv", "up_proj.weight_scale_inv" };
  static const char *qwen_down_scale[] = { "down_proj.weight_scale_inv" };
  static const char *mixtral_up[] = { "w1.weight", "w3.weight" };
  static const char *mixtral_down[] = { "w2.weight" };
  guint n;

  g_return_val_if_fail (MOE_IS_CHECKPOINT (self), NULL);
  g_return_val_if_fail (prefix != NULL, NULL);

  fused = g_strdup_printf ("%s.gate_up_proj", prefix);
  if (g_hash_table_contains (self->entries, fused))
    {
      g_autofree char *down_key = g_strdup_printf ("%s.down_proj", prefix);
      g_autofree char *up_bias_key = g_strdup_printf ("%s.gate_up_proj_bias", prefix);
      g_autofree char *down_bias_key = g_strdup_printf ("%s.down_proj_bias", prefix);
      const gint64 *u, *d;

      up = moe_checkpoint_get_tensor (self, fused, error);
      if (up == NULL || !(down = moe_checkpoint_get_tensor (self, down_key, error)))
        return NULL;
      experts = moe_experts_new (up, down);
      u = moe_tensor_get_shape (up, NULL);
      d = moe_tensor_get_shape (down, NULL);
      if (moe_tensor_get_n_dims (up) == 3 && moe_tensor_get_n_dims (down) == 3 && _moe_fused_experts_transposed (u, d))
        moe_experts_set_is_transposed (experts, TRUE);
      if (g_hash_table_contains (self->entries, up_bias_key))
        {
          g_autoptr(MoeTensor) b = moe_checkpoint_get_tensor (self, up_bias_key, error);
          moe_experts_set_up_bias (experts, b);
        }
      if (g_hash_table_contains (self->entries, down_bias_key))
        {
          g_autoptr(MoeTensor) b = moe_checkpoint_get_tensor (self, down_bias_key, error);
          moe_experts_set_down_bias (experts, b);
        }
      /* transformers' fused FP8 experts: gate_up_proj_scale_inv, down_proj_scale_inv */
      {
        g_autofree char *us_key = g_strdup_printf ("%s.gate_up_proj_scale_inv", prefix);
        g_autofree char *ds_key = g_strdup_printf ("%s.down_proj_scale_inv", prefix);
        if (g_hash_table_contains (self->entries, us_key) && g_hash_table_contains (self->entries, ds_key))
          {
            g_autoptr(MoeTensor) us = moe_checkpoint_get_tensor (self, us_key, error);
            g_autoptr(MoeTensor) ds = us ? moe_checkpoint_get_tensor (self, ds_key, error) : NULL;
            if (ds == NULL)
              {
                g_object_unref (experts);
                return NULL;
              }
            moe_experts_set_up_weight_scale (experts, us);
            moe_experts_set_down_weight_scale (experts, ds);
          }
      }
      return experts;
    }

  if ((n = count_experts (self, prefix, qwen_up[0])) > 0)
    {
      up = fuse_experts (self, prefix, n, qwen_up, 2, error);
      if (up == NULL || !(down = fuse_experts (self, prefix, n, qwen_down, 1, error)))
        return NULL;
      /* quantized checkpoints: the dequantization scales, fused the same way */
      if (count_experts (self, prefix, qwen_up_scale[0]) == n)
        {
          g_autoptr(MoeTensor) us = fuse_experts (self, prefix, n, qwen_up_scale, 2, error);
          g_autoptr(MoeTensor) ds = us ? fuse_experts (self, prefix, n, qwen_down_scale, 1, error) : NULL;
          if (ds == NULL)
            return NULL;
          experts = moe_experts_new (up, down);
          moe_experts_set_up_weight_scale (experts, us);
          moe_experts_set_down_weight_scale (experts, ds);
          return experts;
        }
    }
  else if ((n = count_experts (self, prefix, mixtral_up[0])) > 0)
    {
      up = fuse_experts (self, prefix, n, mixtral_up, 2, error);
      if (up == NULL || !(down = fuse_experts (self, prefix, n, mixtral_down, 1, error)))
        return NULL;
    }
  else
    {
      g_set_error (error, MOE_ERROR, MOE_ERROR_NOT_FOUND,
                   "%s has no experts under “%s” (looked for %s.gate_up_proj, %s.0.gate_proj.weight and %s.0.w1.weight)",
                   self->path, prefix, prefix, prefix, prefix);
      return NULL;
    }
  return moe_experts_new (up, down);
}
