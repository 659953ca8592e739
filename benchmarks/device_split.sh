#!/usr/bin/env bash
# After ../shared/device/prepare.sh: move stage 2's first part into a stage 1b of its own, since
# the tree (about 28 MB tracked, the demo pair's weights most of it) plus .device/s2 (38.5 MB)
# passed the 64 MiB a call may carry in session 23. The GPU calls become
#   run "bash .device/s1/keep.sh"  carry [".device/s1"]
#   run "bash .device/s1b/keep.sh" carry [".device/s1b"]
#   run "bash .device/s2/install.sh >/dev/null && ..." carry [".device/s2"]
# one right after the other (the machine keeps the stash while warm). Idempotent.
set -euo pipefail
d=.device
[[ -f $d/s2/install.sh ]] || { echo "no $d/s2/install.sh: run bash ../shared/device/prepare.sh first"; exit 2; }
if [[ -f $d/s2/part.ab ]]; then
  mkdir -p "$d/s1b"
  mv "$d/s2/part.ab" "$d/s1b/part.ab"
fi
cat > "$d/s1b/keep.sh" <<'KEEP'
#!/usr/bin/env bash
# Stage 1b on the GPU machine (after stage 1): keep the second part beside the first.
set -e
[[ -f /root/hf2q-stash/part.aa ]] || { echo "stage 1 missing: run .device/s1/keep.sh first"; exit 3; }
cp .device/s1b/part.ab /root/hf2q-stash/ && echo "stage 1b kept"
KEEP
chmod u+w "$d/s2" "$d/s2/install.sh"
sed -i 's#cat /root/hf2q-stash/part.aa .device/s2/part.a\[b-z\]#cat /root/hf2q-stash/part.aa /root/hf2q-stash/part.ab .device/s2/part.a[c-z]#' \
  "$d/s2/install.sh"
grep -q 'hf2q-stash/part.ab' "$d/s2/install.sh" || { echo "install.sh not patched: its cat line changed"; exit 4; }
du -sh "$d"/s1 "$d"/s1b "$d"/s2
