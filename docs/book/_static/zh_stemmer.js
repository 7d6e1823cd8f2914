// Sphinx 9.0's Chinese search ends language_data.js with `window.Stemmer = ChineseStemmer;`, a class it never
// defines (its zh search uses the English stemmer), so every search hangs at "Searching..." (sphinx-doc/sphinx
// issue 14229, fixed upstream by pull request 14416). Defined here, before language_data.js loads, it builds the
// English stemmer that file defines; with a fixed Sphinx it is simply unused.
var ChineseStemmer = function () { return new EnglishStemmer(); };
