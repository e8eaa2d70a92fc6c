# Sourced by tests/make_test.sh, tests/run_all.sh and tests/run_mpio.sh (from the repository root).
# children_cpu: sets cpu_now to the CPU seconds (user + system) of the commands this shell has waited
# for so far. Next to the wall time it shows what a leg costs on a machine that other jobs share (on 2
# idle cores, an MPI leg's wall time is about CPU / 2). `times` must run in the calling shell: a $(...)
# subshell has no children of its own.
cpu_now=0
children_cpu() {
  local f
  f=$(mktemp)
  times > "$f"
  cpu_now=$(awk 'function s(t) { split(t, a, "m"); sub("s", "", a[2]); return a[1] * 60 + a[2] }
                 NR == 2 { printf "%d\n", s($1) + s($2) }' "$f")
  rm -f "$f"
}
