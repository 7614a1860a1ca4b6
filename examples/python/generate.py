#!/usr/bin/env python3
# SPDX-License-Identifier: LGPL-2.1-or-later
#
# Loads a Mixture-of-Experts checkpoint and streams a continuation of a
# prompt, token by token, as libmoe generates it in a worker thread while a
# GLib.MainLoop runs here. The model is byte-level (the demo model in
# data/pycoder-moe: 256 ids, one per byte): text in is UTF-8 bytes, ids out
# are bytes again.
#
# Usage, from a build directory's dev environment:
#
#   meson devenv -C _build --workdir . python3 examples/python/generate.py \
#       [CHECKPOINT_DIR] [-p PROMPT] [-n MAX_NEW_TOKENS] [-e BACKEND] \
#       [--dtype DTYPE] [--device DEVICE] [--sample [-t TEMPERATURE] [--top-k K] [--top-p P] [--seed S]]
#
# CHECKPOINT_DIR defaults to data/pycoder-moe. Ctrl-C stops the generation
# (through a Gio.Cancellable) and still prints the speed.

import argparse
import codecs
import os
import signal
import struct
import sys
import time

import gi

gi.require_version('Moe', '1')
from gi.repository import Gio, GLib, Moe  # noqa: E402

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..')
DEFAULT = os.path.join(REPO, 'data', 'pycoder-moe')
DEFAULT_PROMPT = 'def read_config(path):\n    '


def parse_args(argv):
    p = argparse.ArgumentParser(description='Stream a byte-level MoE model\'s continuation of a prompt.')
    p.add_argument('checkpoint', nargs='?', default=DEFAULT, help='checkpoint directory (default: %(default)s)')
    p.add_argument('-p', '--prompt', default=DEFAULT_PROMPT, help='prompt text')
    p.add_argument('-n', '--max-new-tokens', type=int, default=200)
    p.add_argument('-e', '--experts-implementation', metavar='BACKEND',
                   help='experts backend for every sub-config (default: the library\'s, grouped_mm)')
    p.add_argument('--dtype', default='auto', help='auto (the checkpoint\'s), float32, bfloat16 or float16')
    p.add_argument('--device', default='cpu', help='cpu (default), or cuda where the cuda plugin finds a GPU')
    p.add_argument('--sample', action='store_true', help='sample instead of greedy decoding')
    p.add_argument('-t', '--temperature', type=float, default=1.0)
    p.add_argument('--top-k', type=int, default=0)
    p.add_argument('--top-p', type=float, default=1.0)
    p.add_argument('--seed', type=int, default=0)
    return p.parse_args(argv[1:])


def ids_tensor(ids):
    return Moe.Tensor.new_from_bytes(Moe.DType.I64, [1, len(ids)],
                                     GLib.Bytes(struct.pack('<%dq' % len(ids), *ids)))


def ints(tensor):
    data = tensor.dup_bytes().get_data()
    return struct.unpack('<%dq' % (len(data) // 8), data)


class Streamer:
    """Turns the ids of each generation step into text on stdout."""

    def __init__(self, out):
        self.out = out
        self.decoder = codecs.getincrementaldecoder('utf-8')('replace')
        self.n = 0
        self.first = None
        self.last = None

    def token(self, model, tokens, *user_data):
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        self.last = now
        self.n += 1
        tok = ints(tokens)[0]
        if 0 <= tok < 256:
            self.out.write(self.decoder.decode(bytes([tok])))
        else:                           # not a byte: a model with a larger vocabulary
            self.out.write('\u27e8%d\u27e9' % tok)
        self.out.flush()

    def finish(self):
        self.out.write(self.decoder.decode(b'', final=True))
        self.out.flush()


def main(argv):
    args = parse_args(argv)
    opts = Moe.LoadOptions(dtype=args.dtype, device=args.device)
    if args.experts_implementation:
        opts.props.experts_implementation = args.experts_implementation

    loop = GLib.MainLoop()
    cancellable = Gio.Cancellable()
    state = {'status': 0}

    def on_sigint():
        cancellable.cancel()
        return GLib.SOURCE_CONTINUE

    GLib.unix_signal_add(GLib.PRIORITY_DEFAULT, signal.SIGINT, on_sigint)

    def fail(message):
        print('%s: %s' % (args.checkpoint, message), file=sys.stderr)
        state['status'] = 1
        loop.quit()

    def generated(model, result, streamer):
        cancelled = False
        try:
            model.generate_finish(result)
        except GLib.Error as e:
            if not e.matches(Gio.io_error_quark(), Gio.IOErrorEnum.CANCELLED):
                streamer.finish()
                fail(e.message)
                return
            cancelled = True
        streamer.finish()
        prefill = streamer.first - streamer.started if streamer.first else 0.0
        decode_s = streamer.last - streamer.first if streamer.n > 1 else 0.0
        total = (streamer.last or time.perf_counter()) - streamer.started
        print('\n\n%s%d tokens in %.2f s: %.1f tokens/s (first token after %.0f ms; decode %.1f tokens/s)' % (
            '[cancelled] ' if cancelled else '', streamer.n, total,
            streamer.n / total if total > 0 else 0.0, prefill * 1e3,
            (streamer.n - 1) / decode_s if decode_s > 0 else 0.0), file=sys.stderr)
        loop.quit()

    def loaded(source, result, *user_data):
        try:
            model = Moe.Model.new_from_pretrained_finish(result)
        except GLib.Error as e:
            fail(e.message)
            return
        if model.get_vocab_size() < 256:
            fail('not a byte-level model: %d ids' % model.get_vocab_size())
            return
        experts = model.get_experts_implementation()
        print('%s: %s, %s, %d ids, experts: %s' % (
            os.path.basename(os.path.normpath(args.checkpoint)), model.props.config.get_model_type(),
            model.props.dtype, model.get_vocab_size(),
            ', '.join('%s=%s' % (k or '""', v) for k, v in sorted(experts.items()))), file=sys.stderr)

        # the checkpoint's generation defaults, with our length and sampling
        cfg = model.props.generation_config.copy()
        cfg.props.max_new_tokens = args.max_new_tokens
        cfg.props.do_sample = args.sample
        if args.sample:
            cfg.props.temperature = args.temperature
            cfg.props.top_k = args.top_k
            cfg.props.top_p = args.top_p
            cfg.props.seed = args.seed

        prompt = list(args.prompt.encode('utf-8'))
        streamer = Streamer(sys.stdout)
        sys.stdout.write(args.prompt)
        sys.stdout.flush()
        streamer.started = time.perf_counter()
        # The callbacks run on this thread's main context, which the running
        # loop owns here. (Call generate_async from inside the running loop:
        # libmoe may otherwise run them on its worker thread.)
        model.generate_async(ids_tensor(prompt), None, cfg, streamer.token,
                             cancellable=cancellable, callback=generated, user_data=streamer)

    def start():
        Moe.Model.new_from_pretrained_async(args.checkpoint, opts, None, loaded)
        return GLib.SOURCE_REMOVE

    GLib.idle_add(start)
    loop.run()
    return state['status']


if __name__ == '__main__':
    sys.exit(main(sys.argv))
