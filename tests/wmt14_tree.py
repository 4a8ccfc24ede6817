"""A miniature of WMT'14 en-de's download: the five archives under their real names, members and formats.

:func:`build_wmt14_tree` writes, from a few hundred generated English/German-like sentence
pairs (hyphenated compounds such as "Gutach-Zentrum"; in dev and test also ``& < > " '``,
which the SGML holds as entities):

    training-parallel-europarl-v7.tgz   training/europarl-v7.de-en.{de,en}, decoy training/europarl-v7.fr-en.{fr,en}
    training-parallel-commoncrawl.tgz   commoncrawl.de-en.{de,en,annotation}, decoy commoncrawl.fr-en.{fr,en}
    training-parallel-nc-v9.tgz         training/news-commentary-v9.de-en.{de,en}
    dev.tgz                             dev/newstest201{2,3}.{de,en} and dev/newstest201{2,3}-{src,ref}.{en,de}.sgm
    test-full.tgz                       test-full/newstest2014-deen-{src,ref}.{en,de}.sgm, newstest2014-fren-*.sgm

and the same text as plain files under ``plain/``: ``europarl-v7``, ``commoncrawl``,
``news-commentary-v9`` (each ``.en`` / ``.de``), ``train`` (the three concatenated in
that order), ``newstest2012``, ``newstest2013``, ``newstest2014``. SGML documents hold 1-5
segments numbered from 1, some inside ``<p>``, some with an ``<hl>`` headline. The same
arguments give byte-identical files.
"""

from __future__ import annotations

import gzip
import io
import random
import tarfile
from pathlib import Path

# (English, German) word pairs the sentences are made of.
_NOUNS = [
    ("house", "Haus"), ("city", "Stadt"), ("council", "Rat"), ("road", "Straße"), ("parliament", "Parlament"),
    ("report", "Bericht"), ("government", "Regierung"), ("market", "Markt"), ("school", "Schule"),
    ("village", "Dorf"), ("station", "Bahnhof"), ("pedestrian", "Fußgänger"), ("river", "Fluss"),
    ("bridge", "Brücke"), ("museum", "Museum"), ("company", "Firma"), ("commission", "Kommission"),
    ("Gutach centre", "Gutach-Zentrum"), ("EU summit", "EU-Gipfel"), ("safety check", "Sicherheits-Check"),
]  # fmt: skip
_ADJECTIVES = [
    ("new", "neue"), ("old", "alte"), ("small", "kleine"), ("large", "große"), ("safe", "sichere"),
    ("European", "europäische"), ("local", "örtliche"), ("green", "grüne"), ("quiet", "ruhige"),
]  # fmt: skip
_VERBS = [
    ("sees", "sieht"), ("builds", "baut"), ("opens", "öffnet"), ("supports", "unterstützt"),
    ("closes", "schließt"), ("plans", "plant"), ("visits", "besucht"), ("checks", "prüft"),
]  # fmt: skip
_PLACES = ["Gutach", "Berlin", "München", "Brüssel", "Straßburg", "Köln", "Zürich", "Baden-Baden"]
# Dev and test lines with characters SGML writes as entities.
_MARKED = [
    ('the shop "Müller & Söhne"', 'den Laden "Müller & Söhne"'),
    ("the rule a < b > c", "die Regel a < b > c"),
    ("the mayor's plan", "den Plan des Bürgermeister's"),
    ("R&D in the <EU>", "F&E in der <EU>"),
]
_FRENCH = ["la", "maison", "ville", "nouvelle", "voit", "le", "conseil", "pont", "à", "et"]


def _pair(rng: random.Random, marked: bool) -> tuple[str, str]:
    (en_adj, de_adj), (en_noun, de_noun) = rng.choice(_ADJECTIVES), rng.choice(_NOUNS)
    (en_verb, de_verb), (en_obj, de_obj) = rng.choice(_VERBS), rng.choice(_NOUNS)
    place, number = rng.choice(_PLACES), rng.randint(2, 400)
    if marked:
        en_obj, de_obj = rng.choice(_MARKED)
    else:
        en_obj, de_obj = f"the {en_obj}", f"den {de_obj}"
    en = f"The {en_adj} {en_noun} in {place} {en_verb} {en_obj} after {number} days."
    de = f"Der {de_adj} {de_noun} in {place} {de_verb} {de_obj} nach {number} Tagen."
    return en, de


def _pairs(rng: random.Random, count: int, marked_share: float = 0.0) -> list[tuple[str, str]]:
    return [_pair(rng, rng.random() < marked_share) for _ in range(count)]


def _french(rng: random.Random, count: int) -> list[str]:
    return [" ".join(rng.choice(_FRENCH) for _ in range(rng.randint(3, 9))).capitalize() + "." for _ in range(count)]


def _text(lines: list[str]) -> bytes:
    return "".join(line + "\n" for line in lines).encode("utf-8")


def _escape(text: str) -> str:
    return (
        text.replace("&", "&amp;")
        .replace("<", "&lt;")
        .replace(">", "&gt;")
        .replace('"', "&quot;")
        .replace("'", "&#39;")
    )


def _documents(rng: random.Random, count: int) -> list[tuple[str, int]]:
    """(docid, segments) of documents of 1-5 segments holding ``count`` segments."""
    docs, left = [], count
    while left:
        size = min(left, rng.randint(1, 5))
        docs.append((f"{1000 + len(docs) * 7}-{rng.choice(['bbc', 'dw', 'spiegel', 'guardian'])}", size))
        left -= size
    return docs


def _sgml(setid: str, lines: list[str], docs: list[tuple[str, int]], src: str, tgt: str | None) -> bytes:
    """A source set (``tgt`` None) or a reference set in ``tgt`` of ``lines`` cut into ``docs``."""
    head = f'<srcset setid="{setid}" srclang="any">' if tgt is None else (
        f'<refset setid="{setid}" srclang="any" trglang="{tgt}">'
    )  # fmt: skip
    out, at = [head], 0
    for number, (docid, size) in enumerate(docs):
        out.append(f'<doc sysid="ref" docid="{docid}" genre="news" origlang="{src}">')
        wrap = number % 3 != 2  # most documents put their segments in a <p>, some do not
        out += ["<p>"] if wrap else []
        for seg in range(1, size + 1):
            line = f'<seg id="{seg}">{_escape(lines[at])}</seg>'
            out.append(f"<hl>{line}</hl>" if seg == 1 and number % 4 == 1 else line)
            at += 1
        out += ["</p>"] if wrap else []
        out.append("</doc>")
    out.append("</srcset>" if tgt is None else "</refset>")
    return _text(out)


def _newstest_sgml(setid: str, stem: str, pairs: list[tuple[str, str]], docs: list) -> dict[str, bytes]:
    """Both directions' SGML of a test set: ``stem``-src.en.sgm + -ref.de.sgm, -src.de.sgm + -ref.en.sgm."""
    en, de = [e for e, _ in pairs], [d for _, d in pairs]
    return {
        f"{stem}-src.en.sgm": _sgml(setid, en, docs, "en", None),
        f"{stem}-ref.de.sgm": _sgml(setid, de, docs, "en", "de"),
        f"{stem}-src.de.sgm": _sgml(setid, de, docs, "en", None),
        f"{stem}-ref.en.sgm": _sgml(setid, en, docs, "en", "en"),
    }


def write_archive(path: Path, members: dict[str, bytes]) -> Path:
    """A gzip tar archive of ``members`` (name -> bytes) in that order, with their folders; reproducible."""
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=1, mtime=0) as gz:
        with tarfile.open(fileobj=gz, mode="w", format=tarfile.GNU_FORMAT) as tar:
            folders = sorted({str(Path(name).parent) for name in members} - {"."})
            for name, data in [(f, None) for f in folders] + list(members.items()):
                info = tarfile.TarInfo(name)
                info.mtime, info.uname, info.gname = 1393632000, "wmt", "wmt"
                if data is None:
                    info.type, info.mode = tarfile.DIRTYPE, 0o755
                    tar.addfile(info)
                else:
                    info.size, info.mode = len(data), 0o644
                    tar.addfile(info, io.BytesIO(data))
    return path


def build_wmt14_tree(root: Path, sentences: int = 300, seed: int = 0) -> Path:
    """Write the miniature download into ``root`` (created) and return ``root``; see the module's docstring.

    ``sentences`` (at least 60) is the number of en-de pairs over all corpora: 40% europarl, 25% commoncrawl,
    15% news-commentary, and newstest2012, 2013 and 2014 about 6-7% each.
    """
    if sentences < 60:
        raise ValueError(f"sentences={sentences}: at least 60 (every corpus and test set needs a few)")
    rng = random.Random(seed)
    root, plain = Path(root), Path(root) / "plain"
    plain.mkdir(parents=True, exist_ok=True)
    sizes = {"europarl-v7": 40, "commoncrawl": 25, "news-commentary-v9": 15}
    corpora = {name: _pairs(rng, sentences * share // 100) for name, share in sizes.items()}
    held_out = sentences - sum(len(p) for p in corpora.values())
    tests = {f"newstest201{year}": _pairs(rng, held_out // 3 + (year == 4) * (held_out % 3), 0.3) for year in (2, 3, 4)}
    for name, pairs in {**corpora, **tests, "train": [p for c in corpora.values() for p in c]}.items():
        for side, lang in enumerate(("en", "de")):
            (plain / f"{name}.{lang}").write_bytes(_text([p[side] for p in pairs]))

    def sides(stem: str, pairs: list[tuple[str, str]]) -> dict[str, bytes]:
        return {f"{stem}.de": _text([d for _, d in pairs]), f"{stem}.en": _text([e for e, _ in pairs])}

    decoy = _pairs(rng, 20)
    french = {lang: _text(_french(rng, 20) if lang == "fr" else [e for e, _ in decoy]) for lang in ("en", "fr")}
    write_archive(
        root / "training-parallel-europarl-v7.tgz",
        {
            **sides("training/europarl-v7.de-en", corpora["europarl-v7"]),
            "training/europarl-v7.fr-en.en": french["en"],
            "training/europarl-v7.fr-en.fr": french["fr"],
        },
    )
    crawl = corpora["commoncrawl"]
    write_archive(
        root / "training-parallel-commoncrawl.tgz",
        {
            "commoncrawl.de-en.annotation": _text([f"http://www.example.de/seite-{i}.html" for i in range(len(crawl))]),
            **sides("commoncrawl.de-en", crawl),
            "commoncrawl.fr-en.annotation": _text(["http://www.example.fr/"] * 20),
            "commoncrawl.fr-en.en": french["en"],
            "commoncrawl.fr-en.fr": french["fr"],
        },
    )
    write_archive(
        root / "training-parallel-nc-v9.tgz", sides("training/news-commentary-v9.de-en", corpora["news-commentary-v9"])
    )
    dev: dict[str, bytes] = {}
    for year in (2, 3):
        setid = f"newstest201{year}"
        pairs = tests[setid]
        dev |= sides(f"dev/{setid}", pairs)
        dev |= _newstest_sgml(setid, f"dev/{setid}", pairs, _documents(rng, len(pairs)))
    write_archive(root / "dev.tgz", dev)
    test = tests["newstest2014"]
    full = _newstest_sgml("newstest2014", "test-full/newstest2014-deen", test, _documents(rng, len(test)))
    fr_docs = _documents(rng, 20)
    full["test-full/newstest2014-fren-src.en.sgm"] = _sgml("newstest2014", [e for e, _ in decoy], fr_docs, "en", None)
    full["test-full/newstest2014-fren-ref.fr.sgm"] = _sgml("newstest2014", _french(rng, 20), fr_docs, "en", "fr")
    write_archive(root / "test-full.tgz", full)
    return root


# Tiny shapes for `make wmt14` on a CPU: the tiny model (configs/tiny.yaml), 40 steps of 1,024 tokens with a save
# every 10 (the last 3 averaged: WMT14_AVERAGE=3), a 300-piece vocabulary (WMT14_VOCAB=300).
TINY_SETS = (
    "train.max_steps=40 train.save_interval=10 train.keep_last=3 train.eval_interval=0 train.log_interval=10 "
    "data.max_tokens=512 train.tokens_per_step=1024 data.num_workers=0 train.lr_scale=2.0 train.warmup_steps=30 "
    "train.peak_tflops=0.1 parallel.backend=gloo"
)


ROOT_OF_CHECKOUT = Path(__file__).resolve().parents[1]


def make_wmt14(raw: Path, work: Path, *variables: str, env: dict | None = None, timeout: int = 900):
    """``make wmt14`` at tiny shapes with this interpreter's venv (``-o install``: the suite runs from an installed
    one); ``variables`` after the tiny ones win."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    venv = Path(sys.executable).parents[1]
    argv = ["make", "-s", "-o", "install", "wmt14", f"RAW={raw}", f"WMT14_WORK={work}", f"VENV={venv}"]
    argv += [f"PY={sys.executable}", "WMT14_CONFIG=configs/tiny.yaml", "WMT14_VOCAB=300", "WMT14_AVERAGE=3"]
    argv += [f"WMT14_SET={TINY_SETS}", *variables]
    environ = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(argv, cwd=root, capture_output=True, text=True, env=environ, timeout=timeout)
