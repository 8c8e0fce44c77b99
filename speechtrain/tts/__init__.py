"""Text-to-speech: audio codecs (:mod:`speechtrain.tts.codec`) and the text front-end (:mod:`speechtrain.tts.text`)."""
