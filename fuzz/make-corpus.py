#!/usr/bin/env python3
"""Regenerates fuzz/corpus/<target>/ and fuzz/dict/<target>.dict from the
test fixtures (tests/data, plugins, tests/plugins, data/pycoder-moe).

    python3 fuzz/make-corpus.py        # from the source root; stdlib only

The seeds are small real inputs: every test model's safetensors with its
tensor names, dtypes, layout and metadata kept but each dimension shrunk
(per-expert keys still fuse, fused experts keep their proportions), headers
truncated just past their end, the broken files of tests/data/broken, the
indexes, every family's config.json (plus a few RoPE / sliding-window
variants), the generation_config.json files and every .plugin keyfile.
The whole corpus stays well under 1 MB. The dictionaries hold the JSON,
keyfile and safetensors tokens and every config key libmoe reads.
"""
import glob
import hashlib
import json
import math
import os
import re
import shutil
import struct
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FUZZ = os.path.join(ROOT, 'fuzz')
CORPUS = os.path.join(FUZZ, 'corpus')
DICTS = os.path.join(FUZZ, 'dict')
DATA = os.path.join(ROOT, 'tests', 'data')

DTYPE_SIZE = {'F64': 8, 'F32': 4, 'F16': 2, 'BF16': 2, 'F8_E4M3': 1, 'F8_E8M0': 1,
              'I64': 8, 'I32': 4, 'I16': 2, 'I8': 1, 'U8': 1, 'BOOL': 1}


def rel(path):
    return os.path.relpath(path, ROOT)


def read_safetensors(path):
    blob = open(path, 'rb').read()
    n = struct.unpack('<Q', blob[:8])[0]
    return json.loads(blob[8:8 + n]), blob[8 + n:], blob


def pack_safetensors(header, chunks):
    """header: name -> (dtype, shape); chunks: name -> bytes (in header order)."""
    out, data, offset = {}, b'', 0
    for name, entry in header.items():
        if name == '__metadata__':
            out[name] = entry
            continue
        dtype, shape = entry
        b = chunks[name]
        out[name] = {'dtype': dtype, 'shape': shape, 'data_offsets': [offset, offset + len(b)]}
        data += b
        offset += len(b)
    text = json.dumps(out, separators=(',', ':')).encode()
    text += b' ' * (-len(text) % 8)        # the 8-byte alignment safetensors writes
    return struct.pack('<Q', len(text)) + text + data


def shrink(d):
    # 64 -> 2, 32 -> 1, 320 -> 10, 8 experts -> 2: powers of two keep their ratios
    return max(1, d // 32) if d >= 32 else min(d, 2)


def mini(path):
    """The same names, dtypes and metadata, every dimension shrunk, the data
    the first bytes of each tensor's own."""
    header, data, _ = read_safetensors(path)
    small, chunks = {}, {}
    for name, e in header.items():
        if name == '__metadata__':
            small[name] = e
            continue
        shape = [shrink(d) for d in e['shape']]
        n = DTYPE_SIZE[e['dtype']]
        for d in shape:
            n *= d
        begin = e['data_offsets'][0]
        small[name] = (e['dtype'], shape)
        chunks[name] = (data[begin:begin + n] + bytes(n))[:n]
    return pack_safetensors(small, chunks)


def truncated(path, extra=64):
    """The header and the first bytes of the data: offsets run past the end."""
    _, _, blob = read_safetensors(path)
    n = struct.unpack('<Q', blob[:8])[0]
    return blob[:8 + n + extra]


def every_dtype():
    header, chunks = {'__metadata__': {'format': 'pt'}}, {}
    for i, (dtype, size) in enumerate(DTYPE_SIZE.items()):
        header['t.' + dtype.lower()] = (dtype, [3])
        chunks['t.' + dtype.lower()] = bytes((i * 37 + j * 11) & 0xff for j in range(3 * size))
    header['t.empty'] = ('F32', [0, 4])
    chunks['t.empty'] = b''
    header['t.scalar'] = ('F32', [])
    chunks['t.scalar'] = struct.pack('<f', 1.5)
    return pack_safetensors(header, chunks)


def experts_layouts():
    """Tiny experts of each key layout libmoe fuses or uses in place."""
    def f32(n, seed):
        return b''.join(struct.pack('<f', ((seed * 7 + i * 3) % 17) / 8.0 - 1) for i in range(n))

    seeds = {}
    E, H, I = 2, 2, 1
    fused = {'__metadata__': {'format': 'pt'}}
    c = {}
    for name, shape in [('m.experts.gate_up_proj', [E, 2 * I, H]), ('m.experts.down_proj', [E, H, I]),
                        ('m.experts.gate_up_proj_bias', [E, 2 * I]), ('m.experts.down_proj_bias', [E, H])]:
        fused[name] = ('F32', shape)
        c[name] = f32(math.prod(shape), len(c))
    seeds['experts-fused-bias'] = pack_safetensors(fused, c)
    trans = {'m.experts.gate_up_proj': ('BF16', [E, H, 2 * I]), 'm.experts.down_proj': ('BF16', [E, I, H])}
    seeds['experts-transposed-bf16'] = pack_safetensors(
        trans, {k: bytes(range(2 * math.prod(shape))) for k, (_, shape) in trans.items()})
    for style, names in [('qwen', ['gate_proj', 'up_proj', 'down_proj']), ('mixtral', ['w1', 'w3', 'w2'])]:
        h, c = {}, {}
        for e in range(3):
            for j, n in enumerate(names):
                key = 'model.layers.0.mlp.experts.%d.%s.weight' % (e, n)
                shape = [I, H] if j < 2 else [H, I]
                h[key] = ('F16', shape)
                c[key] = bytes(range(e * 8 + j * 2, e * 8 + j * 2 + 2 * I * H))
        seeds['experts-per-expert-' + style] = pack_safetensors(h, c)
    return seeds


def put(target, name, blob, seen):
    digest = hashlib.sha1(blob).hexdigest()
    if digest in seen:
        return
    seen.add(digest)
    with open(os.path.join(CORPUS, target, name), 'wb') as f:
        f.write(blob)


def slug(path):
    return re.sub(r'[^A-Za-z0-9_.-]+', '-', rel(path).replace('tests/data/', '').replace('/', '-'))


def safetensors_seeds(seen):
    t = 'safetensors'
    fixtures = sorted(glob.glob(os.path.join(DATA, 'models', '*', 'model.safetensors')) +
                      glob.glob(os.path.join(DATA, 'experts', '*.safetensors')) +
                      glob.glob(os.path.join(DATA, '*per-expert', 'model.safetensors')) +
                      glob.glob(os.path.join(DATA, 'sharded', '*.safetensors')) +
                      [os.path.join(DATA, 'models', 'qwen3_moe', 'reference.safetensors')])
    for path in fixtures:
        put(t, 'mini-' + slug(path), mini(path), seen)
    for path in [os.path.join(DATA, 'models', 'qwen3_moe', 'model.safetensors'),
                 os.path.join(DATA, 'models', 'gpt_oss', 'model.safetensors'),
                 os.path.join(DATA, 'experts', 'silu_concat.safetensors')]:
        put(t, 'truncated-' + slug(path), truncated(path), seen)
    demo = os.path.join(DATA, 'demo', 'reference.safetensors')
    if os.path.exists(demo):
        put(t, slug(demo), open(demo, 'rb').read(), seen)
    for path in sorted(glob.glob(os.path.join(DATA, 'broken', '**', '*.safetensors'), recursive=True)):
        put(t, slug(path), open(path, 'rb').read(), seen)
    put(t, 'every-dtype.safetensors', every_dtype(), seen)
    for name, blob in experts_layouts().items():
        put(t, name + '.safetensors', blob, seen)


def index_seeds(seen):
    t = 'index'
    for path in sorted(glob.glob(os.path.join(DATA, '**', 'model.safetensors.index.json'), recursive=True)):
        put(t, slug(path), open(path, 'rb').read(), seen)
    sharded = json.load(open(os.path.join(DATA, 'sharded', 'model.safetensors.index.json')))
    one = dict(sharded, weight_map={k: v for k, v in sharded['weight_map'].items() if '00001' in v})
    put(t, 'first-shard-only.json', json.dumps(one, indent=1).encode(), seen)
    put(t, 'empty-weight-map.json', b'{"metadata": {}, "weight_map": {}}', seen)


def config_seeds(seen):
    t = 'config'
    paths = sorted(glob.glob(os.path.join(DATA, 'models', '*', 'config.json')) +
                   glob.glob(os.path.join(DATA, 'configs', '*.json')) +
                   glob.glob(os.path.join(ROOT, 'data', '*', 'config.json')))
    for path in paths:
        put(t, slug(path), open(path, 'rb').read(), seen)
    base = json.load(open(os.path.join(DATA, 'models', 'qwen3_moe', 'config.json')))
    variants = {
        'qwen3_moe-rope-linear.json': {'rope_parameters': {'rope_theta': 10000.0, 'rope_type': 'linear', 'factor': 2.0}},
        'qwen3_moe-rope-yarn.json': {'rope_parameters': {'rope_theta': 10000.0, 'rope_type': 'yarn', 'factor': 4.0,
                                                        'original_max_position_embeddings': 128, 'mscale': 1.0,
                                                        'mscale_all_dim': 1.0, 'partial_rotary_factor': 0.5}},
        'qwen3_moe-rope-scaling-legacy.json': {'rope_parameters': None, 'rope_theta': 5e5,
                                               'rope_scaling': {'type': 'linear', 'factor': 1.5}},
        'qwen3_moe-sliding.json': {'sliding_window': 4, 'use_sliding_window': True,
                                   'layer_types': ['sliding_attention', 'full_attention']},
        'qwen3_moe-sparse-step.json': {'decoder_sparse_step': 2, 'mlp_only_layers': [0]},
        'qwen3_moe-sub-configs.json': {'text_config': {'model_type': 'x', 'vision_config': {'a': [1, 2.5, None]}},
                                       'quantization_config': {'quant_method': 'fp8'}},
    }
    for name, change in variants.items():
        c = dict(base)
        c.update(change)
        put(t, name, json.dumps(c, indent=1).encode(), seen)


def generation_seeds(seen):
    t = 'generation_config'
    paths = sorted(glob.glob(os.path.join(DATA, 'models', '*', 'generation_config.json')) +
                   glob.glob(os.path.join(ROOT, 'data', '*', 'generation_config.json')))
    for path in paths:
        put(t, slug(path), open(path, 'rb').read(), seen)
    put(t, 'every-key.json', json.dumps({
        'max_new_tokens': 16, 'do_sample': True, 'temperature': 0.7, 'top_k': 5, 'top_p': 0.9,
        'eos_token_id': [2, 7], 'pad_token_id': 0, 'bos_token_id': 1}, indent=1).encode(), seen)


def plugin_seeds(seen):
    t = 'plugin'
    paths = sorted(glob.glob(os.path.join(ROOT, 'plugins', '*', '*.plugin')) +
                   glob.glob(os.path.join(ROOT, 'tests', 'plugins', '**', '*.plugin'), recursive=True))
    for path in paths:
        put(t, slug(path), open(path, 'rb').read(), seen)


def dict_line(token):
    out = ''
    for ch in token.encode():
        if ch in (0x22, 0x5c) or ch < 0x20 or ch > 0x7e:
            out += '\\x%02x' % ch
        else:
            out += chr(ch)
    return '"%s"\n' % out


def write_dicts():
    json_tokens = ['{', '}', '[', ']', ':', ',', '"', 'true', 'false', 'null', '""', '-1', '0', '1',
                   '0.5', '1e308', '-1e308', '1e-45', '2147483647', '2147483648', '4294967295',
                   '4294967296', '9223372036854775807', '-9223372036854775808', '18446744073709551616',
                   '\\u0000', '\\ud800', '\\"']
    src = ''.join(open(p).read() for p in glob.glob(os.path.join(ROOT, 'libmoe', '*.c')))
    # every key the library asks a config for
    keys = set(re.findall(r'moe_config_\w+ \([^,]+, "([A-Za-z0-9_]+)"', src))
    keys |= set(re.findall(r'INT \("([a-z0-9_]+)"', src))
    keys |= set(re.findall(r'"([a-z_]+(?:_config|_experts|_tok|_token))"', src))
    for p in glob.glob(os.path.join(CORPUS, 'config', '*')) + glob.glob(os.path.join(CORPUS, 'generation_config', '*')):
        try:
            keys |= set(json.load(open(p)).keys())
        except Exception:
            pass
    values = ['qwen2_moe', 'qwen3_moe', 'qwen3_vl_moe', 'mixtral', 'olmoe', 'deepseek_v3', 'gpt_oss',
              'silu', 'gelu', 'gelu_pytorch_tanh', 'relu', 'default', 'linear', 'yarn',
              'sliding_attention', 'full_attention', 'text_config', 'vision_config']
    with open(os.path.join(DICTS, 'config.dict'), 'w') as f:
        f.write('# JSON tokens, config keys libmoe reads, their string values (fuzz/make-corpus.py)\n')
        for tok in json_tokens + sorted(keys) + values:
            f.write(dict_line(tok if tok in json_tokens else '"%s"' % tok))
    with open(os.path.join(DICTS, 'generation_config.dict'), 'w') as f:
        f.write('# JSON tokens and generation_config.json keys (fuzz/make-corpus.py)\n')
        for tok in json_tokens + ['max_new_tokens', 'do_sample', 'temperature', 'top_k', 'top_p',
                                  'eos_token_id', 'pad_token_id', '1e6', '1000001', '1e-7']:
            f.write(dict_line(tok if tok in json_tokens or tok[0].isdigit() else '"%s"' % tok))
    st = json_tokens + ['"dtype"', '"shape"', '"data_offsets"', '"__metadata__"', '"format"', '"pt"'] + \
        ['"%s"' % d for d in DTYPE_SIZE] + ['experts', '.experts.', '.gate_up_proj', '.down_proj', '_bias',
                                            '.0.gate_proj.weight', '.0.up_proj.weight', '.0.down_proj.weight',
                                            '.1.', '.0.w1.weight', '.0.w2.weight', '.0.w3.weight',
                                            '\x00\x00\x00\x00\x00\x00\x00', '\xff\xff\xff\xff']
    with open(os.path.join(DICTS, 'safetensors.dict'), 'w') as f:
        f.write('# JSON tokens, safetensors header keys, dtypes, experts key names (fuzz/make-corpus.py)\n')
        for tok in st:
            f.write(dict_line(tok))
    with open(os.path.join(DICTS, 'index.dict'), 'w') as f:
        f.write('# JSON tokens, index keys, the harness shards\' file and tensor names (fuzz/make-corpus.py)\n')
        idx = json.load(open(os.path.join(DATA, 'sharded', 'model.safetensors.index.json')))
        for tok in json_tokens + ['"weight_map"', '"metadata"', '"total_size"',
                                  '"model-00001-of-00002.safetensors"', '"model-00002-of-00002.safetensors"',
                                  '"model.safetensors.index.json"', '"."', '".."', '"/"', '"../"'] + \
                ['"%s"' % k for k in idx['weight_map']]:
            f.write(dict_line(tok))
    with open(os.path.join(DICTS, 'plugin.dict'), 'w') as f:
        f.write('# keyfile syntax and the [Moe Plugin] keys (fuzz/make-corpus.py)\n')
        for tok in ['[Moe Plugin]', '[', ']', '=', '\n', '#', ';', '\\s', '\\n', '\\t', '\\\\', '\\;',
                    'Module=', 'Name=', 'Kind=', 'Type=', 'Abi=', 'Abi=1', 'Priority=', 'Devices=', 'Devices=cpu;',
                    'Description=', 'Description[de]=', 'Version=', 'X-Moe-Dtypes=', 'experts-backend',
                    'device', 'eager', 'MoeEagerBackend', '2147483648', '-2147483649', '4294967296']:
            f.write(dict_line(tok))


def main():
    targets = ['safetensors', 'index', 'config', 'plugin', 'generation_config']
    for t in targets:
        shutil.rmtree(os.path.join(CORPUS, t), ignore_errors=True)
        os.makedirs(os.path.join(CORPUS, t))
    os.makedirs(DICTS, exist_ok=True)
    seen = set()
    safetensors_seeds(seen)
    index_seeds(seen)
    config_seeds(seen)
    generation_seeds(seen)
    plugin_seeds(seen)
    write_dicts()
    total = 0
    for t in targets:
        files = os.listdir(os.path.join(CORPUS, t))
        size = sum(os.path.getsize(os.path.join(CORPUS, t, f)) for f in files)
        total += size
        print('%-18s %3d seeds %8d bytes' % (t, len(files), size))
    print('%-18s     %12d bytes' % ('total', total))
    if total >= 1 << 20:
        sys.exit('the corpus is over 1 MB')


if __name__ == '__main__':
    main()
