// SPDX-License-Identifier: LGPL-2.1-or-later
//
// Loads a Mixture-of-Experts checkpoint and streams a continuation of a
// prompt, token by token, as libmoe generates it in a worker thread while a
// GLib.MainLoop runs here. The model is byte-level (the demo model in
// data/pycoder-moe: 256 ids, one per byte): text in is UTF-8 bytes, ids out
// are bytes again.
//
// Usage, from a build directory's dev environment:
//
//   meson devenv -C _build --workdir . gjs -m examples/gjs/generate.js \
//       [CHECKPOINT_DIR] [-p PROMPT] [-n MAX_NEW_TOKENS] [-e BACKEND] [--dtype DTYPE] \
//       [--sample [-t TEMPERATURE] [--top-k K] [--top-p P] [--seed S]]
//
// CHECKPOINT_DIR defaults to data/pycoder-moe. Ctrl-C stops the generation
// (through a Gio.Cancellable) and still prints the speed.

import GLib from 'gi://GLib';
import Gio from 'gi://Gio';
import Moe from 'gi://Moe?version=1';
import System from 'system';

const here = GLib.path_get_dirname(GLib.filename_from_uri(import.meta.url)[0]);
const DEFAULT = GLib.build_filenamev([here, '..', '..', 'data', 'pycoder-moe']);
const SIGINT = 2;

function usage(status) {
    (status ? printerr : print)('usage: generate.js [CHECKPOINT_DIR] [-p PROMPT] [-n MAX_NEW_TOKENS] ' +
        '[-e BACKEND] [--dtype DTYPE] [--sample] [-t TEMPERATURE] [--top-k K] [--top-p P] [--seed S]');
    System.exit(status);
}

function parseArgs(argv) {
    const args = {
        checkpoint: DEFAULT, prompt: 'def read_config(path):\n    ', maxNewTokens: 200, backend: null,
        dtype: 'auto', sample: false, temperature: 1.0, topK: 0, topP: 1.0, seed: 0,
    };
    const number = (flag, v, parse) => {
        const n = parse(v);
        if (v === undefined || Number.isNaN(n)) {
            printerr(`${flag} needs a number`);
            usage(2);
        }
        return n;
    };
    for (let i = 0; i < argv.length; i++) {
        const a = argv[i];
        switch (a) {
        case '-p': case '--prompt': args.prompt = argv[++i] ?? usage(2); break;
        case '-n': case '--max-new-tokens': args.maxNewTokens = number(a, argv[++i], parseInt); break;
        case '-e': case '--experts-implementation': args.backend = argv[++i] ?? usage(2); break;
        case '--dtype': args.dtype = argv[++i] ?? usage(2); break;
        case '--sample': args.sample = true; break;
        case '-t': case '--temperature': args.temperature = number(a, argv[++i], parseFloat); break;
        case '--top-k': args.topK = number(a, argv[++i], parseInt); break;
        case '--top-p': args.topP = number(a, argv[++i], parseFloat); break;
        case '--seed': args.seed = number(a, argv[++i], parseInt); break;
        case '-h': case '--help': usage(0); break;
        default:
            if (a.startsWith('-'))
                usage(2);
            args.checkpoint = a;
        }
    }
    return args;
}

function idsTensor(ids) {
    const flat = BigInt64Array.from(ids, x => BigInt(x));
    return Moe.Tensor.new_from_bytes(Moe.DType.I64, [1, ids.length], new GLib.Bytes(new Uint8Array(flat.buffer)));
}

function ints(tensor) {
    let u8 = tensor.dup_bytes().get_data();
    if (u8.byteOffset % 8 !== 0)
        u8 = u8.slice();
    return Array.from(new BigInt64Array(u8.buffer, u8.byteOffset, u8.length / 8), Number);
}

// Bytes to text as they come: GJS' TextDecoder has no streaming mode, so
// hold back an incomplete UTF-8 sequence until its last byte arrives.
class Utf8Stream {
    constructor() {
        this.decoder = new TextDecoder('utf-8');    // replaces invalid bytes
        this.pending = [];
    }

    static lengthOf(lead) {
        if (lead < 0x80)
            return 1;
        if (lead >= 0xc2 && lead <= 0xdf)
            return 2;
        if (lead >= 0xe0 && lead <= 0xef)
            return 3;
        if (lead >= 0xf0 && lead <= 0xf4)
            return 4;
        return 1;                                   // not a lead byte: replaced
    }

    push(byte) {
        let out = '';
        if (this.pending.length > 0 && (byte & 0xc0) !== 0x80)
            out += this.flush();                    // a sequence cut short
        this.pending.push(byte);
        if (this.pending.length >= Utf8Stream.lengthOf(this.pending[0]))
            out += this.flush();
        return out;
    }

    flush() {
        const text = this.pending.length ? this.decoder.decode(new Uint8Array(this.pending)) : '';
        this.pending = [];
        return text;
    }
}

const stdout = new Gio.UnixOutputStream({fd: 1, close_fd: false});
function write(text) {
    stdout.write_all(new TextEncoder().encode(text), null);
    stdout.flush(null);
}

const args = parseArgs(ARGV);
const loop = new GLib.MainLoop(null, false);
const cancellable = new Gio.Cancellable();
let status = 0;

GLib.unix_signal_add(GLib.PRIORITY_DEFAULT, SIGINT, () => {
    cancellable.cancel();
    return GLib.SOURCE_CONTINUE;
});

function fail(message) {
    printerr(`${args.checkpoint}: ${message}`);
    status = 1;
    loop.quit();
}

function generate(model) {
    if (model.get_vocab_size() < 256) {
        fail(`not a byte-level model: ${model.get_vocab_size()} ids`);
        return;
    }
    const experts = Object.entries(model.get_experts_implementation()).sort()
        .map(([k, v]) => `${k || '""'}=${v}`).join(', ');
    printerr(`${GLib.path_get_basename(args.checkpoint)}: ${model.config.get_model_type()}, ${model.dtype}, ` +
        `${model.get_vocab_size()} ids, experts: ${experts}`);

    // the checkpoint's generation defaults, with our length and sampling
    const cfg = model.generation_config.copy();
    cfg.max_new_tokens = args.maxNewTokens;
    cfg.do_sample = args.sample;
    if (args.sample) {
        cfg.temperature = args.temperature;
        cfg.top_k = args.topK;
        cfg.top_p = args.topP;
        cfg.seed = args.seed;
    }

    const decoder = new Utf8Stream();
    let n = 0, first = 0, last = 0;
    write(args.prompt);
    const started = GLib.get_monotonic_time();

    // The callbacks run on this thread's main context, which the running
    // loop owns here. (Call generate_async from inside the running loop:
    // libmoe may otherwise try to run them on its worker thread.)
    model.generate_async(idsTensor([...new TextEncoder().encode(args.prompt)]), null, cfg, (m, tokens) => {
        last = GLib.get_monotonic_time();
        if (n++ === 0)
            first = last;
        const tok = ints(tokens)[0];
        if (tok >= 0 && tok < 256)
            write(decoder.push(tok));
        else                                      // not a byte: a model with a larger vocabulary
            write(`\u27e8${tok}\u27e9`);
    }, cancellable, (m, res) => {
        let cancelled = false;
        try {
            m.generate_finish(res);
        } catch (e) {
            if (!e.matches(Gio.IOErrorEnum, Gio.IOErrorEnum.CANCELLED)) {
                write(decoder.flush());
                fail(e.message);
                return;
            }
            cancelled = true;
        }
        write(decoder.flush());
        const total = ((n ? last : GLib.get_monotonic_time()) - started) / 1e6;
        const decodeS = n > 1 ? (last - first) / 1e6 : 0;
        printerr(`\n\n${cancelled ? '[cancelled] ' : ''}${n} tokens in ${total.toFixed(2)} s: ` +
            `${(total > 0 ? n / total : 0).toFixed(1)} tokens/s ` +
            `(first token after ${n ? ((first - started) / 1e3).toFixed(0) : '-'} ms; ` +
            `decode ${(decodeS > 0 ? (n - 1) / decodeS : 0).toFixed(1)} tokens/s)`);
        loop.quit();
    });
}

GLib.idle_add(GLib.PRIORITY_DEFAULT, () => {
    const opts = new Moe.LoadOptions({dtype: args.dtype, device: 'cpu'});
    if (args.backend)
        opts.experts_implementation = args.backend;
    Moe.Model.new_from_pretrained_async(args.checkpoint, opts, null, (source, res) => {
        let model;
        try {
            model = Moe.Model.new_from_pretrained_finish(res);
        } catch (e) {
            fail(e.message);
            return;
        }
        generate(model);
    });
    return GLib.SOURCE_REMOVE;
});

loop.run();
System.exit(status);
