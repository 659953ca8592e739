#!/usr/bin/env bash
# After ../shared/device/prepare.sh: re-cut the packed MLX (CUDA) wheels into stages small enough
# to travel beside the tree. One call carries at most 64 MiB: tracked files (about 29 MB, the demo
# pair's weights most of it) plus what it names in carry. prepare.sh's 36 MiB parts passed that in
# session 26, so the stream is cut into three equal pieces (about 25 MB), one stage each, and the GPU calls become
#   run "bash .device/s1/keep.sh"  carry [".device/s1"]     (then s1b, s1c: one call each)
#   run "bash .device/s2/install.sh >/dev/null && ..." carry [".device/s2"]
# one right after the other (the machine keeps the stash while warm, 30 s). Send the first stage
# alone and the rest only once it ran: a refused start costs about 90 s of device time and each
# call in the refusal window after it 15 s (session 29). Write the measuring script before the
# stages, so that no pause lets the machine go. Idempotent.
set -euo pipefail
d=.device
[[ -f $d/s2/install.sh ]] || { echo "no $d/s2/install.sh: run bash ../shared/device/prepare.sh first"; exit 2; }
if ! [[ -f $d/s1/piece.aa ]]; then
  tmp=$(mktemp -d)
  # prepare.sh's parts in order (aa in s1, ab..  in s2; an earlier split may have moved ab to s1b)
  cat $(ls $d/s1/part.a? $d/s1b/part.a? $d/s2/part.a? 2>/dev/null | sort -t. -k3) > "$tmp/stream"
  (cd "$tmp" && split -n 3 stream piece.)
  rm -f $d/s1/part.a? $d/s1b/part.a? $d/s2/part.a? "$tmp/stream"
  stages=(s1 s1b s1c)
  i=0
  for p in "$tmp"/piece.a?; do
    s=${stages[$i]}
    mkdir -p "$d/$s"
    mv "$p" "$d/$s/"
    i=$((i + 1))
  done
  rmdir "$tmp"
fi
for s in s1 s1b s1c; do
  [[ -d $d/$s ]] || continue
  chmod -f u+w "$d/$s/keep.sh" || true
  cat > "$d/$s/keep.sh" <<'KEEP'
#!/usr/bin/env bash
# One stage on the GPU machine: keep this piece of the packed wheels for .device/s2/install.sh.
set -e
mkdir -p /root/hf2q-stash && cp "$(dirname "$0")"/piece.a? /root/hf2q-stash/ && echo "kept $(ls /root/hf2q-stash)"
KEEP
  chmod +x "$d/$s/keep.sh"
done
chmod u+w "$d/s2" "$d/s2/install.sh"
sed -i -E 's#^cat /root/hf2q-stash/part.aa.*\| xz -d#cat /root/hf2q-stash/piece.a? | xz -d#' "$d/s2/install.sh"
sed -i 's#\[\[ -f /root/hf2q-stash/part.aa \]\]#[[ -f /root/hf2q-stash/piece.aa ]]#' "$d/s2/install.sh"
grep -q 'hf2q-stash/piece.a? | xz' "$d/s2/install.sh" || { echo "install.sh not patched: its cat line changed"; exit 4; }
du -sh "$d"/s*
