#!/usr/bin/env python3
"""Rewrites a CUDA source (.cu or .cuh) into host C++ for the SIMT emulator (tools/simt).

- `kernel<<<grid, block[, smem[, stream]]>>>(args)` becomes
  `::simt::Launch({"kernel", __FILE__, __LINE__}, grid, block, smem, stream, kernel, args)`;
- `extern __shared__ T name[];` becomes a pointer to the block's dynamic shared memory;
- each static `__shared__` declaration is followed by the bookkeeping that poisons it at every block start;
- `#pragma unroll` (nvcc's; GCC warns about it) becomes an empty line;
- `#include "x.cuh"` of a rewritten header keeps working: headers are rewritten into the same relative tree.

Only the forms odmoe's kernels use are recognised; anything else is left alone and fails to compile (a `<<<`
left over is a syntax error), never silently. Generated code starts every inserted `::` after a space, so no
`%:` digraph (`#`) can form with a `%` before it.

usage: rewrite_cu.py INPUT OUTPUT
"""
import re
import sys


def find_launch_name_start(text, pos):
    """The start of the kernel expression that ends just before text[pos] ('<<<'): name, ::, template args."""
    i = pos
    while i > 0 and text[i - 1].isspace():
        i -= 1
    while True:
        if i > 0 and text[i - 1] == '>':
            depth = 0
            j = i - 1
            while j >= 0:
                if text[j] == '>':
                    depth += 1
                elif text[j] == '<':
                    depth -= 1
                    if depth == 0:
                        break
                j -= 1
            i = j
            while i > 0 and text[i - 1].isspace():
                i -= 1
        start = i
        while i > 0 and (text[i - 1].isalnum() or text[i - 1] == '_'):
            i -= 1
        if i == start:
            raise SystemExit('rewrite_cu.py: no kernel name before <<< at offset %d' % pos)
        if text[i - 2:i] == '::':
            i -= 2
            continue
        return i


def split_top_level(s):
    parts, depth, cur = [], 0, ''
    for ch in s:
        if ch in '([{':
            depth += 1
        elif ch in ')]}':
            depth -= 1
        if ch == ',' and depth == 0:
            parts.append(cur.strip())
            cur = ''
        else:
            cur += ch
    if cur.strip():
        parts.append(cur.strip())
    return parts


def matching_paren(text, open_pos):
    depth = 0
    for j in range(open_pos, len(text)):
        if text[j] == '(':
            depth += 1
        elif text[j] == ')':
            depth -= 1
            if depth == 0:
                return j
    raise SystemExit('rewrite_cu.py: unbalanced parentheses after a launch')


def rewrite_launches(text):
    out = []
    pos = 0
    while True:
        k = text.find('<<<', pos)
        if k < 0:
            out.append(text[pos:])
            return ''.join(out)
        name_start = find_launch_name_start(text, k)
        name = text[name_start:k].strip()
        end_cfg = text.find('>>>', k)
        cfg = split_top_level(text[k + 3:end_cfg])
        if not 2 <= len(cfg) <= 4:
            raise SystemExit('rewrite_cu.py: launch configuration of %s has %d parts' % (name, len(cfg)))
        while len(cfg) < 4:
            cfg.append('0' if len(cfg) == 2 else 'cudaStream_t{}')
        open_paren = text.index('(', end_cfg)
        close_paren = matching_paren(text, open_paren)
        args = text[open_paren + 1:close_paren].strip()
        line = text.count('\n', 0, name_start) + 1
        # Keep the line count: the launch may span lines, and reports name lines of the original file.
        original = text[name_start:close_paren + 1]
        call = (' ::simt::Launch(::simt::LaunchSite{"%s", __FILE__, %d}, dim3(%s), dim3(%s), '
                'static_cast<size_t>(%s), %s, %s%s)' % (name.replace('"', '\\"').replace('\n', ' '), line, cfg[0],
                                                       cfg[1], cfg[2], cfg[3], name, ', ' + args if args else ''))
        call = call.replace('\n', ' ') + '\n' * original.count('\n')
        out.append(text[pos:name_start])
        out.append(call)
        pos = close_paren + 1


EXTERN_SHARED = re.compile(r'extern\s+__shared__\s+(?:__align__\s*\(\s*\d+\s*\)\s+)?([\w:<>, ]+?)\s+(\w+)\s*\[\s*\]\s*;')
STATIC_SHARED = re.compile(r'(?<!extern )__shared__\s+(?:__align__\s*\(\s*(\d+)\s*\)\s+)?([\w:<>]+(?:\s+[\w:<>]+)*?)\s+(\w+)((?:\s*\[[^\]]*\])*)\s*;')


def rewrite_shared(text):
    text = EXTERN_SHARED.sub(
        lambda m: '%s* const %s = static_cast<%s*>( ::simt::detail::DynamicShared());' % (m[1], m[2], m[1]), text)

    def static(m):
        align = 'alignas(%s) ' % m[1] if m[1] else ''
        name = m[3]
        return ('%sstatic %s %s%s; static ::simt::detail::SharedVar simt_shared_%s; '
                'simt_shared_%s.Touch(&%s, sizeof(%s), "%s");' % (align, m[2], name, m[4], name, name, name, name, name))

    return STATIC_SHARED.sub(static, text)


def main():
    src, dst = sys.argv[1], sys.argv[2]
    with open(src) as f:
        text = f.read()
    text = re.sub(r'^[ \t]*#[ \t]*pragma[ \t]+unroll\b.*$', '', text, flags=re.M)
    text = rewrite_launches(rewrite_shared(text))
    with open(dst, 'w') as f:
        f.write('#line 1 "%s"\n' % src)
        f.write(text)


if __name__ == '__main__':
    main()
