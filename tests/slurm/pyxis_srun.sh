#!/usr/bin/env bash
# A stand-in for `srun` with the pyxis plugin (pyxis and enroot cannot be installed here): put it first on PATH as
# `srun`. It appends its arguments to $PYXIS_STUB_LOG (one line per call, each argument shell-quoted), then applies
# pyxis' environment rule for a step with --container-image: every variable of the image's environment
# ($PYXIS_STUB_IMAGE_ENV: KEY=VALUE lines, what `ENV` set in the image) replaces the host's value, except the
# variables named in --container-env (NAME[,NAME...]), which keep the host's. (pyxis' own text for --container-env:
# "By default, all exported host environment variables are set in the container after the entrypoint is run, but
# their existing values in the image take precedence; the variables specified with this flag are preserved from the
# host".) The --container-* options are then dropped and the step runs: through the real srun when $PYXIS_STUB_SRUN
# names it, else directly here, its srun options (the arguments before the program) dropped too.
set -euo pipefail
printf '%q ' "$@" >> "${PYXIS_STUB_LOG:?}"
printf '\n' >> "$PYXIS_STUB_LOG"

image= keep=() rest=()
for arg in "$@"; do
  case "$arg" in
    --container-image=*) image=${arg#*=} ;;
    --container-env=*) IFS=, read -r -a keep <<< "${arg#*=}" ;;
    --container-*) ;;
    *) rest+=("$arg") ;;
  esac
done
if [ -n "$image" ] && [ -n "${PYXIS_STUB_IMAGE_ENV:-}" ]; then
  while IFS= read -r line; do
    [[ "$line" =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] || continue
    key=${line%%=*}
    [[ " ${keep[*]-} " == *" $key "* ]] || export "$key=${line#*=}"
  done < "$PYXIS_STUB_IMAGE_ENV"
fi
if [ -n "${PYXIS_STUB_SRUN:-}" ]; then
  exec "$PYXIS_STUB_SRUN" "${rest[@]}"
fi
while [ "${#rest[@]}" -gt 0 ] && [[ "${rest[0]}" == -* ]]; do rest=("${rest[@]:1}"); done
exec "${rest[@]}"
