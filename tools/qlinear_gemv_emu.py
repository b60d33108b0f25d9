"""Host emulation of the index math of QLinearGemvKernel (ffi/matmul/qlinear_kernels.cu).

Transcribes the launcher's plan (k-slices, splits, n-tiles per block, slab rows) and the
kernel's addressing (weight tiles per lane, x's B fragments, the raw scale rows, the Dequant
slab entries, the per-warp partial-sum slots and the block's final sum) into Python, builds
each warp's 16 x 64 A and 64 x 8 B operands from what every lane would hold, and compares
the result with a float64 reference. It checks the mapping, not the roundings (the math is
float64 here; tools/qlinear_check.cu --gemv checks the kernel itself on the GPU). Keep it in
step with the kernel when the mapping changes.

    python3 tools/qlinear_gemv_emu.py
"""

import numpy as np
import itertools
import sys

kQTileN, kQTileK, kWarps, kThreads = 16, 64, 8, 256


def WPL(bits):
  return 4 if bits == 4 else 8


def QPackedAt(bits, r, c):
  h, gq = r // 8, r % 8
  s, kh, tq, e = c // 16, (c % 16) // 8, (c % 8) // 2, c % 2
  lane = 4 * gq + tq
  if bits == 4:
    return lane * 4 + s, 4 * (4 * e + 2 * kh + h)
  return lane * 8 + 2 * s + kh, 8 * (2 * h + e)


def cdiv(a, b):
  return (a + b - 1) // b


def run(G, Gw, M, K, N, gs, bits, has_z, ws_floats, sms, rng):
  KT, NT, R = cdiv(K, 64), cdiv(N, 16), K // gs
  wpt = 32 * WPL(bits)
  q = rng.integers(0, 1 << bits, size=(Gw, K, N))
  z = rng.integers(0, 1 << bits, size=(Gw, R, N)) if has_z else None
  sc = rng.uniform(0.5, 1.5, size=(Gw, R, N))
  x = rng.uniform(-1, 1, size=(G, M, K))
  packed = np.zeros((Gw, KT, NT, wpt), dtype=np.uint64)
  for gw in range(Gw):
    for k in range(K):
      for n in range(N):
        wd, sh = QPackedAt(bits, n % 16, k % 64)
        packed[gw, k // 64, n // 16, wd] |= np.uint64(int(q[gw, k, n]) << sh)
  packed = packed.astype(np.uint32).reshape(-1)
  mid = 1 << (bits - 1)
  # reference
  ref = np.zeros((G, M, N))
  for g in range(G):
    gw = 0 if Gw == 1 else g
    zz = z[gw] if has_z else np.full((R, N), mid)
    w = (q[gw] - np.repeat(zz, gs, axis=0)) * np.repeat(sc[gw], gs, axis=0)
    ref[g] = x[g] @ w
  # launcher
  KS = 4 if bits == 4 else 2
  need = cdiv(KT, KS)
  kw = 1
  while kw < kWarps and kw < need:
    kw *= 2
  splits = cdiv(KT, kw * KS)
  out_elems = G * M * N
  by_ws = max(1, min(32, ws_floats // out_elems))
  if not (M <= 8 and (R == 1 or gs % 64 == 0) and splits <= by_ws):
    return None
  nw = kWarps // kw
  round_tiles = kw * KS
  tpg = 1 if R == 1 else gs // 64
  slab_rows = 1 if R == 1 else min(R, (round_tiles - 1) // tpg + 2)
  per_nt = slab_rows * 128 + kw * M * 64 + slab_rows * 48 + 32
  nb_max = max(1, 102400 // per_nt)
  slots = sms * 2
  nb, best = 1, -1
  for c in range(1, min(nb_max, NT) + 1):
    cost = cdiv(cdiv(NT, c) * splits * G, slots) * (c + 2)
    if best < 0 or cost <= best:
      best, nb = cost, c
  nblocks = cdiv(NT, nb)
  grid = nblocks * splits * G
  y = np.full((G, M, N), np.nan)
  wsp = np.full((splits, G, M, N), np.nan)
  RowOf = lambda kt: 0 if R == 1 else kt // tpg
  for bid in range(grid):
    nblk = bid % nblocks
    split = bid // nblocks % splits
    g = bid // nblocks // splits
    gw = 0 if Gw == 1 else g
    nt0 = nblk * nb
    nbl = min(NT - nt0, nb)
    kt_s0 = split * round_tiles
    kt_s1 = min(kt_s0 + round_tiles, KT)
    kF = nb * 16
    n0 = nt0 * 16
    kr0, kr1 = kt_s0, kt_s1
    row0 = RowOf(kr0)
    nrows = RowOf(kr1 - 1) - row0 + 1
    assert nrows <= slab_rows
    raw_s = np.zeros((slab_rows, kF))
    raw_z = np.zeros((slab_rows, kF))
    for c in range(nrows * nbl * 2):
      row, f = c // (nbl * 2), c % (nbl * 2) * 8
      for e in range(8):
        if n0 + f + e < N:
          raw_s[row, f + e] = sc[gw, row0 + row, n0 + f + e]
          raw_z[row, f + e] = z[gw, row0 + row, n0 + f + e] if has_z else 0
    slab = {}
    for e in range(nrows * nbl * 8):
      row, rem = e // (nbl * 8), e % (nbl * 8)
      f = rem // 8 * 16 + rem % 8
      zz = lambda ff: raw_z[row, ff] if has_z else mid
      slab[((rem // 8) * slab_rows + row) * 8 + rem % 8] = (
        raw_s[row, f],
        zz(f),
        raw_s[row, f + 8],
        zz(f + 8),
      )
    out = {}
    for warp in range(8):
      ks, ng = warp % kw, warp // kw
      cnt = (nbl - ng + nw - 1) // nw if ng < nbl else 0
      kw0 = kr0 + ks * KS
      kvalid = [kw0 + kk < kr1 for kk in range(KS)]
      # x fragments per lane
      xb = np.zeros((32, KS, 4, 2, 2))
      for lane in range(32):
        gq, tq = lane >> 2, lane & 3
        kl0 = kw0 * 64 + 2 * tq
        left = K - kl0 if gq < M else 0
        lim = min(left, KS * 64)
        for kk, s, hb in itertools.product(range(KS), range(4), range(2)):
          o = kk * 64 + 16 * s + 8 * hb
          for e in range(2):
            if o + e < lim:
              xb[lane, kk, s, hb, e] = x[g, gq, kl0 + o + e]
      k0c = min(kw0, kr1 - 1)
      rows4 = [RowOf(min(kw0 + kk, kr1 - 1)) - RowOf(k0c) for kk in range(KS)]
      for i in range(cnt + (cnt % 2)):  # phantom on odd cnt
        j = ng + (i if i < cnt else cnt - 1) * nw
        acc = np.zeros((16, 8))
        for kk in range(KS):
          ent_idx = lambda gq: (j * slab_rows + (RowOf(k0c) - row0) + rows4[kk]) * 8 + gq
          A = np.zeros((16, 16 * 4))
          B = np.zeros((64, 8))
          kt = kw0 + kk
          nt = nt0 + ng + i * nw
          for lane in range(32):
            gq, tq = lane >> 2, lane & 3
            ent = slab[ent_idx(gq)]
            if kvalid[kk] and i < cnt:
              base = ((gw * KT + kt) * NT + nt) * wpt + lane * WPL(bits)
              words = [int(packed[base + t]) for t in range(WPL(bits))]
            else:
              words = None  # zero or stale: x is zero here (checked below)
            for s in range(4):
              for reg in range(4):
                kh, h = reg >> 1, reg & 1
                for e in range(2):
                  if words is None:
                    qv = 0
                  elif bits == 4:
                    qv = (words[s] >> (4 * reg + 16 * e)) & 0xF
                  else:
                    qv = (words[2 * s + kh] >> (8 * (2 * h + e))) & 0xFF
                  sv, zv = ent[2 * h], ent[2 * h + 1]
                  A[gq + 8 * h, 16 * s + 8 * kh + 2 * tq + e] = (qv - zv) * sv
                for hb in range(2):
                  for e in range(2):
                    B[16 * s + 8 * hb + 2 * tq + e, gq] = xb[lane, kk, s, hb, e]
          if words is None and i < cnt:
            assert not B.any()
          acc += A @ B
        if i < cnt:
          for tok in range(M):
            for f in range(16):
              out[(ks, j, tok, f)] = acc[f, tok]
    for e in range(nbl * M * 16):
      j, rem = e // (M * 16), e % (M * 16)
      tok, f = rem // 16, rem % 16
      n = (nt0 + j) * 16 + f
      if n >= N:
        continue
      v = sum(out[(s, j, tok, f)] for s in range(kw))
      if splits == 1:
        y[g, tok, n] = v
      else:
        wsp[split, g, tok, n] = v
  if splits > 1:
    y = wsp.sum(axis=0)
  err = np.abs(y - ref).max()
  return err, dict(kw=kw, splits=splits, nb=nb, nblocks=nblocks, grid=grid)


def main():
  rng = np.random.default_rng(1)
  # (G, Gw, M, K, N, group_size, bits, zeros, workspace floats, SMs)
  cases = [
    (1, 1, 1, 64, 16, 64, 4, True, 1 << 20, 4),
    (1, 1, 3, 200, 33, 200, 4, False, 1 << 20, 4),
    (2, 2, 5, 640, 40, 128, 8, True, 1 << 20, 3),
    (3, 1, 8, 4096, 50, 64, 4, True, 1 << 20, 5),
    (1, 1, 2, 4096, 17, 4096, 8, False, 1 << 20, 2),
    (2, 1, 7, 2304, 100, 256, 4, True, 3 * 2 * 7 * 100, 7),
    (1, 1, 1, 8256, 24, 64, 8, True, 1 << 20, 2),
    (1, 1, 4, 136, 15, 136, 8, True, 1 << 20, 2),
  ]
  worst = 0.0
  for c in cases:
    r = run(*c, rng)
    print(c, r)
    worst = max(worst, r[0] / (1 + abs(c[3])))
  print("worst error / K:", worst)
  sys.exit(0 if worst < 1e-12 else 1)


if __name__ == "__main__":
  main()
