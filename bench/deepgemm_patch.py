"""Replaces the three ``std::regex`` uses of DeepGEMM's host code (a copy of its ``csrc/``) by
plain string scans of the same meaning; run by ``bench/deepgemm_build.sh``.

    python3 bench/deepgemm_patch.py CSRC

Why: in the device's torch 2.11 process, DeepGEMM's first ``fp8_mqa_logits`` call segfaulted
inside libstdc++'s regex compiler (``IncludeParser::get_includes`` -> ``_BracketMatcher::
_M_ready``: a cuda-gdb backtrace, bench/RESULTS.md, "DeepGEMM's indexer logits as an anchor").
The scans: ``#\\s*include\\s*[<"][^>"]+[>"]`` (the include lines hashed for the kernel cache),
nvcc's ``release X.Y`` and ptxas's ``Local memory used``. Exits non-zero with one line when a
use is not found exactly once (another DeepGEMM commit).
"""

from __future__ import annotations

import sys

INCLUDES_OLD = r'''        const std::regex pattern(R"(#\s*include\s*[<"][^>"]+[>"])");
        std::sregex_iterator iter(code.begin(), code.end(), pattern);
        const std::sregex_iterator end;

        // TODO: parse relative paths as well
        for (; iter != end; ++ iter) {
            const auto include_str = iter->str();
'''
INCLUDES_NEW = r'''        // the matches of #\s*include\s*[<"][^>"]+[>"] in order, scanned by hand (no std::regex)
        std::vector<std::string> found;
        const auto blank = [](const char c) {
            return c == ' ' or c == '\t' or c == '\n' or c == '\r' or c == '\f' or c == '\v';
        };
        for (size_t at = code.find('#'); at != std::string::npos; at = code.find('#', at + 1)) {
            size_t i = at + 1;
            while (i < code.size() and blank(code[i])) ++ i;
            if (code.compare(i, 7, "include") != 0) continue;
            i += 7;
            while (i < code.size() and blank(code[i])) ++ i;
            if (i >= code.size() or (code[i] != '<' and code[i] != '"')) continue;
            size_t j = i + 1;
            while (j < code.size() and code[j] != '>' and code[j] != '"') ++ j;
            if (j >= code.size() or j == i + 1) continue;
            found.push_back(code.substr(at, j + 1 - at));
            at = j;
        }

        // TODO: parse relative paths as well
        for (const auto& include_str: found) {
'''
RELEASE_OLD = r'''        std::smatch match;
        DG_HOST_ASSERT(std::regex_search(output, match, std::regex(R"(release (\d+\.\d+))")));
        std::sscanf(match[1].str().c_str(), "%d.%d", &major, &minor);
'''
RELEASE_NEW = r'''        const auto release_at = output.find("release ");  // no std::regex
        DG_HOST_ASSERT(release_at != std::string::npos);
        DG_HOST_ASSERT(std::sscanf(output.c_str() + release_at + 8, "%d.%d", &major, &minor) == 2);
'''
LOCAL_OLD = r'''            DG_HOST_ASSERT(not std::regex_search(output, std::regex(R"(Local memory used)")));
'''
LOCAL_NEW = r'''            DG_HOST_ASSERT(output.find("Local memory used") == std::string::npos);
'''
EDITS = {
    "jit/include_parser.hpp": [(INCLUDES_OLD, INCLUDES_NEW)],
    "jit/compiler.hpp": [(RELEASE_OLD, RELEASE_NEW), (LOCAL_OLD, LOCAL_NEW)],
}


def main(root: str) -> int:
    for name, edits in EDITS.items():
        path = f"{root}/{name}"
        with open(path) as f:
            text = f.read()
        for old, new in edits:
            if text.count(old) != 1:
                print(f"deepgemm_patch: {name}: a std::regex use to replace is there "
                      f"{text.count(old)} times, expected once (another DeepGEMM commit?)")
                return 1
            text = text.replace(old, new)
        with open(path, "w") as f:
            f.write(text)
        print(f"deepgemm_patch: {name}: {len(edits)} std::regex use(s) replaced")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python3 bench/deepgemm_patch.py CSRC")
    sys.exit(main(sys.argv[1]))
