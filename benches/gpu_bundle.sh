#!/usr/bin/env bash
# What a lent GPU needs (issue 33), as four parts for four device calls back to back.
#
#   bash benches/gpu_bundle.sh          # here, from the project root, after bash .ci/setup (about 3 minutes)
#
# ../shared/gpu/make-bundle.sh packs MLX's CUDA build and the packages the device lacks; this adds
# what it misses: the wheels this .venv installed from local files (`pip freeze` says NAME @ file://;
# llguidance, which kvmem imports) and the default model's GGUF for the needle rows. The bundle and
# the GGUF become one byte stream in four parts of about 49 MB (a call carries 64 MiB, the working
# tree included). Then, on the device (each `run` within 30 s of the last, or the machine is a new one):
#
#   run command="bash benches/gpu_device.sh" carry=[".gpu/p1"]     # then .gpu/p2, then .gpu/p3
#   run command="bash benches/gpu_device.sh go -- CMD..." carry=[".gpu/p4", ".gpu/w", ".gpu/site_bytes"]
#
# CMD runs in the project root on MLX's CUDA backend, with $KVMEM_NEEDLE_GGUF naming the GGUF, e.g.
#   bash -c 'python3 -m benches gpu --out $OUT --needle-model $KVMEM_NEEDLE_GGUF --needles 20'
# or the prepared session, `bash benches/gpu_session.sh bench`, then `... suite` (see its header).
set -euo pipefail
[ -x .venv/bin/python ] || { echo "run from the project root after bash .ci/setup" >&2; exit 1; }
# make-bundle.sh asks pip for manylinux 2_35, 2_28 and 2_17 wheels; pip takes those tags literally, and
# llguidance 1.9's only Linux wheel is manylinux_2_31: run a copy of it that asks for 2_31 too
M=$(mktemp -d)
cp ../shared/gpu/* "$M"/
sed -i 's/--platform manylinux_2_28_x86_64/--platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64/' "$M/make-bundle.sh"
bash "$M/make-bundle.sh"
rm -rf "$M"
site=$(( $(stat -c %s .gpu/p1/part.1) + $(stat -c %s .gpu/p2/part.2) ))
gguf=$(.venv/bin/python -c 'from runtime.model.default_model import default_model_file; print(default_model_file())')
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT
cat .gpu/p1/part.1 .gpu/p2/part.2 "$gguf" > "$W/all"
rm -rf .gpu/p1 .gpu/p2 .gpu/p3 .gpu/p4 .gpu/w
mkdir -p .gpu/p1 .gpu/p2 .gpu/p3 .gpu/p4 .gpu/w
split -n 4 -d -a 1 "$W/all" "$W/part."
for i in 0 1 2 3; do mv "$W/part.$i" ".gpu/p$((i + 1))/part.$((i + 1))"; done
echo "$site" > .gpu/site_bytes
.venv/bin/python -m pip freeze | sed -n 's#^.* @ file://\(.*\.whl\).*#\1#p' | while read -r wheel; do
  case "$wheel" in *abi3*|*cp312*|*py3-none*) cp "$wheel" .gpu/w/ ;; *) echo "not carried (no cp312 build): $wheel" ;; esac
done
ls -la .gpu/p1 .gpu/p2 .gpu/p3 .gpu/p4 .gpu/w | grep -E 'part|whl'
