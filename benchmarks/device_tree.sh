#!/usr/bin/env bash
# Set benchmarks/results/ aside from the git index for a GPU session, and put it back afterwards.
# Why: a device call copies what git sees (tracked + untracked-not-ignored files) and refuses more than 64 MiB,
# carried folders included; benchmarks/results/ (JSON, PNG, checkpoints/*.tgz) is most of the 100+ MB.
#
#   bash benchmarks/device_tree.sh set-aside [KEEP ...]
#       Ignores benchmarks/results/ in .git/info/exclude (saved first as .git/info/exclude.device-tree, or, where there
#       was none, the marker .git/info/exclude.device-tree-absent) and takes it out of the index, except KEEP: tracked
#       files under it, as paths from the repo root, subfolders too (default
#       benchmarks/results/learning_curves_h200_w256_qp16_prose.json). Refuses when the index differs from HEAD
#       (staged work would be mixed in), when already set aside, or for a KEEP that is not such a file.
#   bash benchmarks/device_tree.sh restore
#       `git reset -- benchmarks/results` (nothing else in the index) and .git/info/exclude back byte for byte (or
#       none, where there was none). Refuses when not set aside.
#   bash benchmarks/device_tree.sh size
#       The bytes a device call would copy now (carry aside) and the room left under 64 MiB (negative: over).
#
# Working-tree files are never touched. Do not commit while set aside: the commit would delete the results.
# Refusals and usage: one line on stderr starting with "device_tree: ", exit code 2. set-aside and restore end with
# the size line. Runs from any directory.
set -euo pipefail

LIMIT=$((64 * 1024 * 1024))
RESULTS=benchmarks/results
DEFAULT_KEEP=$RESULTS/learning_curves_h200_w256_qp16_prose.json
export GIT_LITERAL_PATHSPECS=1 # KEEP names are file names, not globs

die() { printf 'device_tree: %s\n' "$*" >&2; exit 2; }
usage() {
  die "usage: bash benchmarks/device_tree.sh set-aside [KEEP ...] | restore | size"
}

cd "$(dirname "${BASH_SOURCE[0]}")"
cd "$(git rev-parse --show-toplevel)"
exclude=$(git rev-parse --git-path info/exclude)
saved=$exclude.device-tree
absent=$exclude.device-tree-absent

is_set_aside() { [[ -e $saved || -e $absent ]]; }

size() {
  local bytes
  bytes=$(git ls-files -z --cached --others --exclude-standard --deduplicate |
    while IFS= read -r -d '' f; do
      if [[ -L $f || -f $f ]]; then printf '%s\0' "$f"; fi
    done | xargs -0 -r stat -c %s -- | awk '{ s += $1 } END { printf "%d", s }')
  printf 'device tree: %d bytes, room left under 64 MiB: %d bytes\n' "$bytes" $((LIMIT - bytes))
}

# a path as a gitignore pattern that matches only itself
pattern() {
  printf '%s' "$1" | sed -e 's/[][\\*?]/\\&/g' -e 's/ $/\\ /'
}

set_aside() {
  is_set_aside && die "already set aside ($saved or $absent exists): run restore first"
  git diff --cached --quiet || die "the index differs from HEAD: commit or unstage first (staged work would be mixed in)"
  local keep=("$@") k d
  [[ ${#keep[@]} -gt 0 ]] || keep=("$DEFAULT_KEEP")
  for k in "${keep[@]}"; do
    [[ $k == "$RESULTS"/?* && $k != *$'\n'* ]] || die "KEEP $k is not a path under $RESULTS/"
    [[ $(git ls-files -z --cached -- "$k" | tr '\0' '\n') == "$k" ]] || die "KEEP $k is not a tracked file"
    [[ -f $k ]] || die "KEEP $k is not in the working tree"
  done
  # every folder between benchmarks/results and a KEEP: re-included, then its contents excluded (git cannot re-include
  # a file whose folder is excluded); sorted, so a folder's lines come before those of its subfolders
  local dirs
  dirs=$(for k in "${keep[@]}"; do
    d=${k%/*}
    while [[ $d != "$RESULTS" ]]; do printf '%s\n' "$d"; d=${d%/*}; done
  done | LC_ALL=C sort -u)

  if [[ -e $exclude ]]; then
    cp -p -- "$exclude" "$saved"
  else
    mkdir -p "$(dirname "$exclude")"
    : >"$absent"
    : >"$exclude"
  fi
  {
    if [[ -s $exclude && $(tail -c 1 "$exclude" | wc -l) -eq 0 ]]; then printf '\n'; fi # a last line without \n
    printf '/%s/*\n' "$RESULTS"
    if [[ -n $dirs ]]; then
      while IFS= read -r d; do printf '!/%s/\n/%s/*\n' "$(pattern "$d")" "$(pattern "$d")"; done <<<"$dirs"
    fi
    for k in "${keep[@]}"; do printf '!/%s\n' "$(pattern "$k")"; done
  } >>"$exclude"
  git rm -r -q --cached --ignore-unmatch -- "$RESULTS"
  git add -- "${keep[@]}"
  size
}

restore() {
  is_set_aside || die "not set aside (neither $saved nor $absent exists)"
  git reset -q -- "$RESULTS"
  if [[ -e $saved ]]; then
    mv -f -- "$saved" "$exclude"
  else
    rm -f -- "$exclude"
  fi
  rm -f -- "$absent"
  size
}

[[ $# -gt 0 ]] || usage
command=$1
shift
case $command in
  set-aside) set_aside "$@" ;;
  restore) [[ $# -eq 0 ]] || usage; restore ;;
  size) [[ $# -eq 0 ]] || usage; size ;;
  *) usage ;;
esac
