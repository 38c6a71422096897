#!/usr/bin/env bash
# Checks that the package (`cargo package --list`) holds everything the documentation points at:
#
# - every relative Markdown link in README.md and docs/**/*.md (the guide is also compiled into
#   the crate's documentation, so its links must resolve inside the package, not only in the
#   repository);
# - every repository file named in a code span of those pages (`tests/gpu/`, `ui-tests/`, ...);
#   spans that name nothing tracked (bench ids, paths outside the repository) are not paths here;
# - every file the crate's sources include at compile time (`include_str!`, `include_bytes!`),
#   which `cargo package`'s verify build also catches, but only for the code it compiles.
#
# Links with a scheme (https:, mailto:), pure anchors and rustdoc intra-doc paths
# (`crate::guide::rules`) are not files and are skipped, and so is `python/`: the Python module is
# a package of its own (python/pyproject.toml), built from the repository, never part of the
# crate's. Prints every miss, fails if any.
set -euo pipefail
cd "$(dirname "$0")/.."

listed=$(cargo package --list --allow-dirty --quiet)
misses=""

# Whether the package holds `path` (a file) or something under it (a folder).
in_package() {
  local path=${1%/}
  [[ $path == python || $path == python/* ]] && return 0
  grep -qxF -- "$path" <<<"$listed" || grep -q -- "^${path//./\\.}/" <<<"$listed"
}

miss() {
  misses+="not in the package: $2 (referenced by $1)"$'\n'
}

# `target` as seen from `from_dir`, relative to the repository root; fails if it leaves it.
resolve() {
  local resolved
  resolved=$(realpath -m --relative-to=. -- "$1/$2")
  [[ $resolved != ../* && $resolved != .. ]] || return 1
  printf '%s\n' "$resolved"
}

pages=(README.md)
while IFS= read -r page; do pages+=("$page"); done < <(find docs -name '*.md' | sort)

for page in "${pages[@]}"; do
  in_package "$page" || miss "the package's documentation" "$page"
  dir=$(dirname "$page")
  # Inline links `](target "title")` and reference definitions `[name]: target`.
  while IFS= read -r target; do
    target=${target%%#*}
    [[ -z $target || $target =~ ^[A-Za-z][A-Za-z0-9+.-]*: || $target == *::* ]] && continue
    if ! resolved=$(resolve "$dir" "$target"); then
      miss "$page" "$target (outside the repository)"
    elif ! in_package "$resolved"; then
      miss "$page" "$resolved"
    fi
  done < <(
    grep -oE '\]\([^) ]+' "$page" | sed 's/^](//'
    grep -oE '^ {0,3}\[[^]]+\]: *[^ ]+' "$page" | sed -E 's/^[^]]*\]: *//'
  )
  # Code spans naming tracked files or folders, relative to the repository root.
  while IFS= read -r span; do
    while IFS= read -r file; do
      in_package "$file" || miss "$page" "$file (named as \`$span\`)"
    done < <(git ls-files -- ":(glob)${span%/}" ":(glob)${span%/}/**")
  done < <(grep -oE '`[A-Za-z0-9_.*-]+(/[A-Za-z0-9_.*-]*)+`' "$page" | tr -d '`' | grep -v '^\.\./' | sort -u)
done

# Files included at compile time, relative to the including source file.
while IFS= read -r source; do
  dir=$(dirname "$source")
  while IFS= read -r target; do
    if ! resolved=$(resolve "$dir" "$target") || ! in_package "$resolved"; then
      miss "$source" "$target"
    fi
  done < <(grep -oE 'include_(str|bytes)!\("[^"]+"\)' "$source" | sed -E 's/^[^"]*"//; s/"\)$//')
done < <(grep -E '\.rs$' <<<"$listed")

if [[ -n $misses ]]; then
  printf '%s' "$misses" | sort -u >&2
  echo "some documented references point outside the package" >&2
  exit 1
fi
echo "package: every documented link, named file and included file is in the package"
