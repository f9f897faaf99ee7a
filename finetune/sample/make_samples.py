#!/usr/bin/env python
"""Write the small NER (IOB2) and news-classification samples in this folder from hand-written templates.

Run once; the outputs are committed. Deterministic: the same seed gives the same files.
"""

import csv
import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent

PER = [
    "রহিম উদ্দিন",
    "করিম",
    "সালমা খাতুন",
    "নাসরিন আক্তার",
    "সুমন",
    "তানভীর আহমেদ",
    "মিতু",
    "রাকিব হাসান",
    "ফারহানা",
    "জাহিদ",
    "শাহানা পারভীন",
    "অনিক",
    "রুমানা",
    "মাহমুদুল হক",
    "সাবরিনা",
    "আরিফ",
]
ORG = [
    "বাংলাদেশ ব্যাংক",
    "ঢাকা বিশ্ববিদ্যালয়",
    "গ্রামীণফোন",
    "জাতিসংঘ",
    "বাংলা একাডেমি",
    "বিশ্বব্যাংক",
    "আবাহনী ক্লাব",
    "ব্র্যাক",
    "বাংলাদেশ বিমান",
    "রাজশাহী বিশ্ববিদ্যালয়",
    "বিসিবি",
    "পানি উন্নয়ন বোর্ড",
]
LOC = [
    "ঢাকা",
    "চট্টগ্রাম",
    "সিলেট",
    "খুলনা",
    "রাজশাহী",
    "কক্সবাজার",
    "বরিশাল",
    "রংপুর",
    "কলকাতা",
    "ময়মনসিংহ",
    "নেপাল",
    "লন্ডন",
    "কুমিল্লা",
    "গাজীপুর",
]
NER_TEMPLATES = [
    "{PER} গতকাল {LOC} গিয়েছিলেন ।",
    "{ORG} আজ একটি নতুন প্রকল্প ঘোষণা করেছে ।",
    "{PER} {ORG} -এ চাকরি করেন ।",
    "{LOC} শহরে {ORG} একটি অফিস খুলেছে ।",
    "আগামী মাসে {PER} {LOC} সফরে যাবেন ।",
    "{ORG} -এর প্রধান {PER} সাংবাদিকদের সঙ্গে কথা বলেন ।",
    "{PER} ও {PER} একসঙ্গে {LOC} থেকে ফিরেছেন ।",
    "বৃষ্টির কারণে {LOC} ও {LOC} অঞ্চলে যান চলাচল ব্যাহত হয় ।",
    "{ORG} জানিয়েছে যে {LOC} -এ নতুন শাখা চালু হবে ।",
    "শিক্ষার্থীরা {ORG} প্রাঙ্গণে মানববন্ধন করেছে ।",
    "{PER} বলেন , {LOC} আমার প্রিয় শহর ।",
    "গত বছর {PER} {ORG} থেকে পুরস্কার পেয়েছেন ।",
    "আজ সকালে বাজারে সবজির দাম বেড়েছে ।",
    "মেলায় অনেক মানুষের ভিড় ছিল ।",
]

NEWS = {
    "kolkata": [
        "কলকাতা পুরসভা {X} এলাকায় নতুন রাস্তা তৈরির কাজ শুরু করেছে",
        "কলকাতার মেট্রোতে আজ {X} যাত্রী বেড়েছে",
        "হাওড়া সেতুর কাছে {X} যানজট দেখা দেয়",
        "কলকাতা পুলিশ শহরের {X} মোড়ে নজরদারি বাড়িয়েছে",
        "সল্টলেকে {X} নতুন বাজার চালু হয়েছে",
    ],
    "state": [
        "রাজ্য সরকার জেলার {X} কৃষকদের জন্য নতুন প্রকল্প ঘোষণা করেছে",
        "মুখ্যমন্ত্রী {X} জেলায় প্রশাসনিক বৈঠক করেন",
        "রাজ্যের {X} পঞ্চায়েত নির্বাচনের প্রস্তুতি চলছে",
        "জেলা প্রশাসন {X} গ্রামে ত্রাণ বিতরণ করেছে",
        "রাজ্যের বিধানসভায় {X} বিল পাস হয়েছে",
    ],
    "national": [
        "কেন্দ্রীয় সরকার দেশের {X} রেল প্রকল্প অনুমোদন করেছে",
        "সংসদে আজ {X} বাজেট নিয়ে আলোচনা হয়",
        "প্রধানমন্ত্রী জাতির উদ্দেশে {X} ভাষণ দিয়েছেন",
        "নির্বাচন কমিশন দেশজুড়ে {X} ভোটের তারিখ ঘোষণা করেছে",
        "কেন্দ্রীয় মন্ত্রিসভা {X} নতুন নীতি অনুমোদন দিয়েছে",
    ],
    "sports": [
        "ফাইনাল ম্যাচে দল {X} গোলে জিতেছে",
        "ক্রিকেট সিরিজের প্রথম টেস্টে অধিনায়ক {X} রান করেছেন",
        "ফুটবল লিগে আজ {X} দলের খেলা হবে",
        "অলিম্পিকে দেশের খেলোয়াড় {X} পদক জিতেছেন",
        "টি-টোয়েন্টি ম্যাচে বোলার {X} উইকেট নিয়েছেন",
    ],
    "entertainment": [
        "নতুন চলচ্চিত্রে নায়িকা {X} চরিত্রে অভিনয় করেছেন",
        "জনপ্রিয় গায়কের {X} গানের অ্যালবাম প্রকাশিত হয়েছে",
        "পরিচালক তাঁর {X} ছবির শুটিং শুরু করেছেন",
        "টেলিভিশন নাটকের {X} পর্ব দর্শকদের মন জয় করেছে",
        "চলচ্চিত্র উৎসবে অভিনেতা {X} পুরস্কার পেয়েছেন",
    ],
    "international": [
        "যুক্তরাষ্ট্রের প্রেসিডেন্ট {X} দেশ সফরে গেছেন",
        "জাতিসংঘের সাধারণ পরিষদে {X} প্রস্তাব গৃহীত হয়েছে",
        "ইউরোপের {X} দেশে তাপপ্রবাহ চলছে",
        "চীন ও জাপানের মধ্যে {X} বাণিজ্য চুক্তি হয়েছে",
        "মধ্যপ্রাচ্যে {X} শান্তি আলোচনা শুরু হয়েছে",
    ],
}
FILLERS = ["দুই", "তিন", "পাঁচ", "দশ", "নতুন", "বড়", "গুরুত্বপূর্ণ", "প্রথম", "শেষ", "বিশেষ", "একাধিক", "আরও"]
TAILS = ["", " বলে জানা গেছে", " বলে সূত্র জানিয়েছে", " আজ সকালে", " গতকাল রাতে", " এ সপ্তাহে"]


def ner_sentence(rng: random.Random) -> list[tuple[str, str]]:
    template = rng.choice(NER_TEMPLATES)
    tagged = []
    for word in template.split():
        kind = word[1:-1] if word.startswith("{") and word.endswith("}") else None
        if kind in ("PER", "ORG", "LOC"):
            entity = rng.choice({"PER": PER, "ORG": ORG, "LOC": LOC}[kind]).split()
            tagged += [(w, ("B-" if i == 0 else "I-") + kind) for i, w in enumerate(entity)]
        else:
            tagged.append((word, "O"))
    return tagged


def main() -> None:
    rng = random.Random(2021)
    for split, count in [("train", 240), ("validation", 60), ("test", 60)]:
        sentences = [ner_sentence(rng) for _ in range(count)]
        with open(HERE / f"ner_{split}.conll", "w", encoding="utf-8") as f:
            f.write("\n\n".join("\n".join(f"{w} {t}" for w, t in s) for s in sentences) + "\n")
        with open(HERE / f"ner_{split}.jsonl", "w", encoding="utf-8") as f:
            for s in sentences:
                f.write(json.dumps({"tokens": [w for w, _ in s], "ner_tags": [t for _, t in s]}, ensure_ascii=False))
                f.write("\n")
    for split, per_class in [("train", 40), ("validation", 10), ("test", 10)]:
        rows = []
        for label, templates in NEWS.items():
            rows += [
                {"text": rng.choice(templates).format(X=rng.choice(FILLERS)) + rng.choice(TAILS) + "।", "label": label}
                for _ in range(per_class)
            ]
        rng.shuffle(rows)
        with open(HERE / f"news_{split}.csv", "w", encoding="utf-8", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["text", "label"])
            writer.writeheader()
            writer.writerows(rows)


if __name__ == "__main__":
    main()
