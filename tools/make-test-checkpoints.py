#!/usr/bin/env python3
"""Writes the hand-made checkpoints under tests/data: deliberately broken
safetensors files, a sharded checkpoint and per-expert (unfused) checkpoints
built from a transformers fixture. Standard library only.

    python3 tools/make-test-checkpoints.py   # from the repository root
"""
import json, os, struct, sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'tests', 'data')
SIZES = {'F64': 8, 'F32': 4, 'F16': 2, 'BF16': 2, 'I64': 8, 'I32': 4, 'I8': 1, 'U8': 1}


def read(path):
    with open(path, 'rb') as f:
        raw = f.read()
    n = struct.unpack('<Q', raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    meta = header.pop('__metadata__', None)
    tensors = {k: (v['dtype'], v['shape'], data[v['data_offsets'][0]:v['data_offsets'][1]])
               for k, v in header.items()}
    return tensors, meta


def write(path, tensors, meta=None):
    header, blobs, off = {}, [], 0
    if meta:
        header['__metadata__'] = meta
    for name, (dtype, shape, blob) in tensors.items():
        header[name] = {'dtype': dtype, 'shape': shape, 'data_offsets': [off, off + len(blob)]}
        blobs.append(blob)
        off += len(blob)
    raw_write(path, json.dumps(header).encode(), b''.join(blobs))


def raw_write(path, header_bytes, data, pad=True):
    if pad:
        header_bytes += b' ' * (-len(header_bytes) % 8)
    with open(path, 'wb') as f:
        f.write(struct.pack('<Q', len(header_bytes)) + header_bytes + data)


def broken():
    d = os.path.join(ROOT, 'broken')
    os.makedirs(d, exist_ok=True)
    f32 = struct.pack('<4f', 1, 2, 3, 4)
    good = {'a': {'dtype': 'F32', 'shape': [2, 2], 'data_offsets': [0, 16]}}
    cases = {
        # name: (header object or raw header bytes, data)
        'short': None,
        'header-past-eof': None,
        'not-json': (b'{"a": {"dtype": ', f32),
        'duplicate-name': (b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, '
                           b'"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}', f32),
        'not-object': (b'[1, 2, 3]', f32),
        'offsets-outside': ({'a': {'dtype': 'F32', 'shape': [2, 2], 'data_offsets': [0, 32]}}, f32),
        'offsets-reversed': ({'a': {'dtype': 'F32', 'shape': [0], 'data_offsets': [16, 0]}}, f32),
        'overlap': ({'a': {'dtype': 'F32', 'shape': [2, 2], 'data_offsets': [0, 16]},
                     'b': {'dtype': 'F32', 'shape': [2], 'data_offsets': [8, 16]}}, f32),
        'size-mismatch': ({'a': {'dtype': 'F32', 'shape': [3, 2], 'data_offsets': [0, 16]}}, f32),
        'unknown-dtype': ({'a': {'dtype': 'F128', 'shape': [1], 'data_offsets': [0, 16]}}, f32),
        'negative-shape': ({'a': {'dtype': 'F32', 'shape': [-4], 'data_offsets': [0, 16]}}, f32),
        'huge-shape': ({'a': {'dtype': 'F32', 'shape': [2**40, 2**40], 'data_offsets': [0, 16]}}, f32),
        'missing-offsets': ({'a': {'dtype': 'F32', 'shape': [4]}}, f32),
        'bad-metadata': ({'__metadata__': {'k': 5}, **good}, f32),
        'too-many-dims': ({'a': {'dtype': 'F32', 'shape': [1] * 9 + [4], 'data_offsets': [0, 16]}}, f32),
    }
    for name, case in cases.items():
        path = os.path.join(d, name + '.safetensors')
        if name == 'short':
            with open(path, 'wb') as f:
                f.write(b'\x10\x00\x00')
        elif name == 'header-past-eof':
            with open(path, 'wb') as f:
                f.write(struct.pack('<Q', 1 << 20) + b'{}')
        else:
            header, data = case
            hb = header if isinstance(header, bytes) else json.dumps(header).encode()
            raw_write(path, hb, data)

    # a sharded checkpoint whose index names a missing shard, and one that
    # names a shard outside the directory
    for name, shard in (('index-missing-shard', 'model-00002-of-00002.safetensors'),
                        ('index-escapes', '../broken/overlap.safetensors'),
                        ('index-duplicate', None)):
        sub = os.path.join(d, name)
        os.makedirs(sub, exist_ok=True)
        write(os.path.join(sub, 'model-00001-of-00002.safetensors'),
              {'a': ('F32', [4], f32)})
        with open(os.path.join(sub, 'model.safetensors.index.json'), 'w') as f:
            if shard is None:
                f.write('{"weight_map": {"a": "model-00001-of-00002.safetensors", '
                        '"a": "model-00001-of-00002.safetensors"}}')
            else:
                json.dump({'metadata': {}, 'weight_map': {'a': 'model-00001-of-00002.safetensors', 'b': shard}}, f)
    os.makedirs(os.path.join(d, 'empty-dir'), exist_ok=True)
    with open(os.path.join(d, 'empty-dir', 'README'), 'w') as f:
        f.write('A checkpoint directory with no safetensors files, for tests.\n')


def split_expert_rows(dtype, shape, blob):
    """[E, R, C] -> list of E blobs of [R, C]"""
    e, per = shape[0], len(blob) // shape[0]
    return [blob[i * per:(i + 1) * per] for i in range(e)]


def unfused(fixture):
    tensors, meta = read(os.path.join(ROOT, 'experts', fixture + '.safetensors'))
    dt, up_shape, up = tensors['up_weight']
    _, down_shape, down = tensors['down_weight']
    E, two_i, H = up_shape
    I = two_i // 2
    row = H * SIZES[dt]
    inputs = {k: tensors[k] for k in ('hidden_states', 'top_k_index', 'top_k_weights', 'output_f64')}

    # Qwen-style per-expert keys, experts written in a shuffled order so that
    # a lexical sort (0, 1, 10, 11, …, 2) would be caught
    qwen, mixtral = dict(inputs), dict(inputs)
    order = sorted(range(E), key=lambda e: str(e))[::-1]
    ups, downs = split_expert_rows(dt, up_shape, up), split_expert_rows(dt, down_shape, down)
    for e in order:
        gate_blob, up_blob = ups[e][:I * row], ups[e][I * row:]
        p = 'model.layers.0.mlp.experts.%d.' % e
        qwen[p + 'gate_proj.weight'] = (dt, [I, H], gate_blob)
        qwen[p + 'up_proj.weight'] = (dt, [I, H], up_blob)
        qwen[p + 'down_proj.weight'] = (dt, [H, I], downs[e])
        p = 'model.layers.0.block_sparse_moe.experts.%d.' % e
        mixtral[p + 'w1.weight'] = (dt, [I, H], gate_blob)
        mixtral[p + 'w3.weight'] = (dt, [I, H], up_blob)
        mixtral[p + 'w2.weight'] = (dt, [H, I], downs[e])
    write(os.path.join(ROOT, 'per-expert', 'model.safetensors'), qwen, meta)
    write(os.path.join(ROOT, 'mixtral-per-expert', 'model.safetensors'), mixtral, meta)



def sharded(fixture):
    tensors, meta = read(os.path.join(ROOT, 'experts', fixture + '.safetensors'))
    # the fixture split over two shards with an index
    names = sorted(tensors)
    half = len(names) // 2
    shards = {'model-00001-of-00002.safetensors': names[:half],
              'model-00002-of-00002.safetensors': names[half:]}
    weight_map = {}
    for shard, keys in shards.items():
        write(os.path.join(ROOT, 'sharded', shard), {k: tensors[k] for k in keys}, meta)
        weight_map.update({k: shard for k in keys})
    with open(os.path.join(ROOT, 'sharded', 'model.safetensors.index.json'), 'w') as f:
        json.dump({'metadata': {'total_size': sum(len(t[2]) for t in tensors.values())},
                   'weight_map': weight_map}, f, indent=1)


if __name__ == '__main__':
    broken()
    unfused('gelu_concat')
    sharded('silu_concat')
