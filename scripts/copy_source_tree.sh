# Sourced by compile_cuda.sh and sanitize.sh, which build the source tree apart from the checkout.
# copy_source_tree REPO WORK PYTHON: copy the repository's files (tracked, and new ones not
# ignored; no build outputs) into WORK, and make sure PYTHON can run `python setup.py`.
copy_source_tree() {
  local repo="$1" work="$2" python="$3"
  (cd "$repo" && git ls-files -z --cached --others --exclude-standard |
    while IFS= read -r -d '' f; do [[ -f "$f" ]] && printf '%s\0' "$f"; done |
    tar --null -T - -cf - | tar -xf - -C "$work")
  # `python setup.py` needs setuptools (>= 77 reads pyproject's license string), which venvs of
  # Python >= 3.12 no longer come with
  "$python" -c "import setuptools, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 77)" 2>/dev/null ||
    "$python" -m pip install -q "setuptools>=77"
}
