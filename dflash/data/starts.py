"""Starts of user requests, per kind of request people make of a chat model: the seeds of
`embedded:ask-general` and `embedded:ask-code` (dflash/data/embedded.py).

A start is the first words of a user turn. `dflash generate --ask-temperature T` lets the target
continue each one to the end of its turn, sampled at `T`, and then answer the request it wrote
(Magpie-style data: requests as the target imagines them, answers as it gives them). The starts
only steer which kind of request it writes; the words after them are the target's. Some end
mid-sentence, some open a code block or a quoted text, so that the requests differ in form too.

FOLLOW_UP_STARTS begin a second user turn after the target's first answer
(`dflash generate --turns 2`).
"""

KINDS = ("writing", "rewriting", "advice", "explanation", "reasoning", "extraction", "roleplay", "stem",
         "humanities", "planning", "tool-call", "code")

_WRITING = (
    "Write a short story about", "Write a poem about", "Can you write a haiku about", "Write a cover letter for",
    "Write an email to my manager asking", "Draft a polite message to my neighbour about",
    "Write a product description for", "I need a wedding toast for my", "Write a limerick about",
    "Write the opening paragraph of a mystery novel set in", "Compose a thank-you note to",
    "Write a blog post about", "Write a speech for", "Can you write a bedtime story for a five-year-old about",
    "Write a LinkedIn post announcing", "Write song lyrics about", "Write a dialogue between",
    "Write a persuasive essay arguing that", "Write a short horror story that takes place in",
    "Give me three taglines for", "Write a eulogy for", "Write a birthday message for my",
    "Write a recipe introduction for", "Write a press release announcing", "Write a sonnet about",
    "Write a funny tweet about", "Draft a complaint letter to", "Write a scene where two characters",
    "Write a fable with a moral about", "Write a motivational message for", "Please write a short essay on",
    "Write an apology email to a customer whose", "Write a children's rhyme about", "Write a newsletter intro for",
    "Write a villain's monologue in which", "I'm writing a novel. Write a chapter where",
    "Write a cheerful announcement for our office that",
)
_REWRITING = (
    "Summarize the following article in three sentences:\n\n", "Rewrite this paragraph to sound more formal:\n\n",
    "Can you make this email shorter and friendlier?\n\n", "Paraphrase the following text:\n\n",
    "Fix the grammar in this sentence:", "Translate the following into French:", "Translate this to Spanish:",
    "Summarize this meeting transcript into action items:\n\n", "Make this text easier for a child to understand:",
    "Turn these notes into a coherent paragraph:\n\n", "Proofread my essay introduction:\n\n",
    "Rewrite this sentence in the passive voice:", "Condense this into a single tweet:",
    "Give me a TL;DR of this:\n\n", "Rewrite the following in plain English:\n\n",
    "Make this cover letter sound more confident:\n\n", "Summarize the plot of", "Rephrase this so it sounds less rude:",
    "Edit this paragraph for clarity:\n\n", "Rewrite this product review as a bulleted list of pros and cons:\n\n",
    "Summarize the key points of this abstract:\n\n", "Shorten this to under 50 words:",
    "Rewrite this text in the style of Shakespeare:", "Convert this informal message into a professional email:\n\n",
    "Can you simplify this legal clause?\n\n", "Rewrite the following headline to be more catchy:",
    "Summarize this chat conversation between", "Turn this bullet list into prose:\n\n-",
    "Correct the spelling mistakes in:", "Rewrite this in a more neutral tone:\n\n",
    "Give me a one-paragraph summary of the book", "Rewrite this recipe so it serves",
    "Make my bio sound more professional:", "Reword this question so it is clearer:",
    "Translate this German sentence into English:", "Summarize the following customer feedback:\n\n",
    "Expand these bullet points into a full paragraph:\n\n-",
)
_ADVICE = (
    "How can I improve my sleep", "What should I do if my coworker", "I'm feeling stressed about",
    "How do I ask my boss for", "What are some tips for", "My friend keeps", "How do I start saving money when",
    "Should I quit my job to", "How can I be more productive when", "What's the best way to learn",
    "I have a job interview tomorrow for", "How do I deal with", "My partner and I keep arguing about",
    "How can I make friends after moving to", "What should I look for when buying", "Any advice for a first-time",
    "How do I stop procrastinating on", "I'm nervous about public speaking. How",
    "What are good habits for", "How do I negotiate a higher salary", "My dog won't stop",
    "How can I tell my parents that", "What should I pack for", "Is it a good idea to",
    "How do I politely decline", "What can I do to feel less lonely", "How should I prepare for my first",
    "I want to get into running. How", "How do I keep houseplants alive when",
    "My teenager spends too much time on", "How can I reduce my screen time", "What's a healthy way to",
    "I just got promoted to manager. How", "How do I choose between", "Can you give me advice on",
    "I keep forgetting", "How do I stay motivated while",
)
_EXPLANATION = (
    "Explain how", "What is the difference between", "Why does", "Can you explain", "How does",
    "What does it mean when", "Explain like I'm five:", "What is", "Why is the sky", "How do vaccines",
    "Explain the concept of", "What happens when", "Why do people", "How do airplanes",
    "What causes", "Explain the rules of", "How does the stock market", "What's the point of",
    "Can you break down how", "Why do cats", "What are the main ideas of", "Explain in simple terms what",
    "How does inflation", "What is the purpose of", "Why does ice", "Explain the difference between a",
    "How do search engines", "What exactly is", "Why are some", "How does a refrigerator",
    "What is the origin of the word", "Explain why", "How do noise-cancelling headphones",
    "What makes", "Help me understand", "Why can't", "How is",
)
_REASONING = (
    "A train leaves the station at", "If I have 3 apples and", "Solve for x:", "A farmer has", "What is 15% of",
    "Sarah is twice as old as", "A store sells pencils at", "If a car travels at", "There are 5 red balls and",
    "Three friends split a bill of", "A rectangle has a perimeter of", "Is the following argument valid?",
    "Which number comes next in the sequence", "If all bloops are razzies and", "A tank fills in",
    "John has $", "How many ways can", "A recipe needs 2 cups of flour for", "What is the probability of",
    "Calculate the compound interest on", "If it takes 5 machines 5 minutes to", "A clock shows",
    "Solve this riddle:", "A baker made", "The sum of two numbers is", "Four people need to cross a bridge",
    "If today is Wednesday, what day", "A shirt costs $20 after a", "Emma reads 30 pages a day.",
    "Prove that", "A ladder 10 meters long", "There are 30 students in a class.", "Work out step by step:",
    "Which is larger,", "A box contains", "Logic puzzle:", "Tom runs a lemonade stand.",
)
_EXTRACTION = (
    "Extract all the dates from the following text:\n\n", "Convert this table to JSON:\n\n",
    "List the names of all people mentioned in:\n\n", "Turn the following into a CSV with columns",
    "Pull out the email addresses from this text:", "Format this as a markdown table:\n\n",
    "Extract the ingredients and quantities from this recipe:\n\n", "Classify the sentiment of these reviews:\n\n1.",
    "From the text below, extract the company name, role and salary:\n\n", "Convert this YAML to JSON:\n\n```yaml\n",
    "Parse this address into street, city and postal code:", "Give me a JSON object with the fields",
    "Put these items into alphabetical order:", "Extract the key terms from this paragraph:\n\n",
    "Sort these words by length:", "Which of these sentences are questions?\n\n",
    "Turn this paragraph into a bulleted list of facts:\n\n", "Make a table comparing",
    "Extract every phone number from:", "Convert these temperatures from Fahrenheit to Celsius:",
    "Categorize these expenses into food, transport and housing:\n\n", "Fill in this template with",
    "Identify the named entities in:", "Reformat this list of names as 'Last, First':\n\n",
    "Extract the action items and their owners from:\n\n", "Convert this CSV to a markdown table:\n\n",
    "Tag each of these tweets as spam or not spam:\n\n", "Give me a JSON list of", "Normalize these dates to ISO 8601:",
    "Pull the product names and prices out of this receipt:\n\n", "Create an outline with headings from this text:\n\n",
    "Count how many times each word appears in:", "Extract the citations from this paragraph:\n\n",
    "Group these animals by habitat:", "Turn this schedule into a table:\n\n",
    "What are the keywords in this job posting?\n\n", "Label each sentence with its language:\n\n",
)
_ROLEPLAY = (
    "Pretend you are a pirate and", "You are a medieval innkeeper. A traveller walks in and",
    "Act as my job interviewer for", "Let's play a game where you are", "Roleplay as a customer service agent for",
    "You are Sherlock Holmes. I tell you that", "Pretend to be my grandmother telling me about",
    "Act as a tour guide in", "You are a wizard who", "Be a Socratic tutor and ask me questions about",
    "Pretend you're a detective interrogating", "You are a spaceship's AI and", "Play the role of a grumpy chef who",
    "Act like a sports commentator describing", "You are a travel agent. I want to",
    "Let's do a text adventure. I am standing in", "Pretend you are Albert Einstein explaining",
    "You are my personal trainer and", "Roleplay a negotiation where you are selling", "Act as a Linux terminal. My first command is",
    "You're a barista at a busy cafe and", "Pretend you are a cat who", "You are a knight guarding a bridge.",
    "Act as a language partner and talk to me in", "Be a dungeon master for", "You are a news anchor reporting on",
    "Pretend you're my therapist and", "Play a shopkeeper in a fantasy town who sells",
    "You are a robot learning about", "Act as an 18th-century explorer writing in your journal about",
    "Pretend you are a ghost haunting", "You are the captain of a sinking ship.",
    "Act as a debate opponent arguing that", "You are a friendly alien visiting Earth for the first time and",
    "Pretend to be a famous chef judging my", "You are my startup's cofounder and",
    "Stay in character as a noir private eye and",
)
_STEM = (
    "How do I calculate the derivative of", "Explain the photoelectric effect", "What is the integral of",
    "Balance this chemical equation:", "What is Newton's second law and", "How does DNA replication",
    "Explain eigenvalues and eigenvectors", "What is the pH of", "How do black holes",
    "Explain the central limit theorem", "What is the time complexity of", "How does a transistor",
    "Derive the formula for", "What is entropy in", "Explain how photosynthesis", "Calculate the molar mass of",
    "What is the difference between mitosis and", "How do I find the eigenvalues of the matrix",
    "Explain Bayes' theorem with", "What are the laws of thermodynamics", "How does CRISPR",
    "What is a Fourier transform", "Explain the Doppler effect", "How do I solve the differential equation",
    "What is quantum entanglement", "How does an electric motor", "Explain Ohm's law", "Prove that the square root of 2",
    "What is the Big O of", "How do plate tectonics", "Explain the structure of an atom",
    "What is the speed of sound in", "How do neural networks", "What's the difference between speed and velocity",
    "Explain the Krebs cycle", "How does a hash table", "What is a p-value and",
)
_HUMANITIES = (
    "What were the causes of", "Who was", "Explain the main ideas of Stoicism", "What is the significance of",
    "Compare the philosophies of", "Analyze the theme of", "What was life like in",
    "Why did the Roman Empire", "What is the meaning of the poem", "Discuss the impact of",
    "Who wrote", "What are the main arguments in", "How did the printing press", "Describe the art style of",
    "What is existentialism", "Explain the symbolism in", "What led to the fall of", "How did jazz",
    "What is the difference between Baroque and", "Summarize Plato's", "What role did women play in",
    "How did the Silk Road", "What is the historical context of", "Explain Kant's", "Why is Shakespeare",
    "What are the major world religions'", "How did the Renaissance", "Who were the main figures of",
    "What is utilitarianism and", "Analyze the character of", "What happened during the",
    "How did colonialism affect", "What does the term 'the sublime'", "Describe the architecture of",
    "What is the Socratic method", "How has the English language", "Why do historians disagree about",
)
_PLANNING = (
    "Plan a 3-day trip to", "Make me a weekly meal plan for", "Create a study schedule for", "Help me plan a birthday party for",
    "Create a workout routine for", "Give me a 30-day plan to", "Plan a budget for", "Make a packing list for",
    "Outline a project plan for", "Help me organize my week. I have", "Create an itinerary for a weekend in",
    "Plan a wedding on a budget of", "Design a training plan for a", "Make a checklist for moving to",
    "Give me a daily routine that", "Plan a team-building event for", "Create a reading list for",
    "How should I structure my day if", "Plan a garden for", "Make a schedule for learning",
    "Create a launch plan for", "Help me prepare for a marathon in", "Plan a road trip from",
    "Outline a lesson plan on", "Make a cleaning schedule for", "Plan a dinner party menu for",
    "Create a content calendar for", "Help me set goals for", "Design a curriculum for",
    "I have two weeks to", "Plan my first week at", "Create a morning routine for", "Give me a step-by-step plan to",
    "Make a timeline for", "Plan a camping trip to", "Organize a fundraiser for", "Create a revision plan for my",
)
_TOOL_CALL = (
    'You have a function get_weather(city: str, unit: str). Call it to answer:',
    "Given the tool search_flights(origin, destination, date), produce the JSON arguments for:",
    'Call the function send_email with the right arguments to', "Respond only with a JSON function call that",
    'Available tools: [{"name": "get_stock_price", "parameters": {"symbol": "string"}}]. User:',
    "Use the calculator tool to", "Which function should be called, and with what arguments, to",
    'I have an API create_event(title, start_time, end_time, attendees). Generate the call for',
    "Output a tool call in JSON to look up", "You can call search(query: str). Find out",
    "Generate the JSON arguments for book_restaurant given:", "Using the function translate(text, target_language),",
    'Tools: get_time(timezone), get_weather(location). Question:', "Write the function call to add",
    "Return a JSON object with the arguments for the function", "Call set_reminder to",
    "Given the schema below, produce a valid function call:\n\n", "Which of these tools would you use to",
    'You are an assistant with access to a database tool query(sql). Answer:', "Produce the arguments to call",
    "With the function convert_currency(amount, from, to),", 'Make a tool call to the "lookup_order" function for',
    "Emit a function call that", "Use the tool get_directions to", "Create the JSON payload for a POST request that",
    "Call the appropriate function to", 'Function: create_ticket(title: str, priority: "low"|"high", body: str).',
    "Given these tools, plan the sequence of calls needed to", "Fill in the arguments of update_user(id, fields) to",
    "Respond with a function call to play_music that", "You can use the tool wikipedia_search. Find",
    "Generate an OpenAI-style tool call that", "Call the function list_files with the arguments that",
    "Using run_python(code), compute", "Format a function call to schedule_meeting for",
    "Write the tool call JSON for sending a text message to", "With access to a get_news(topic, count) function,",
)
# The first three are embedded:ask-code's original starts: HumanEval's instruction with an open code
# block (the target fills it with a function of its own; the third opens it as typed Python often
# does) and a request the target words itself.
_CODE = (
    "Complete the following Python function.\n\n```python\n", "Write a Python function",
    "Complete the following Python function.\n\n```python\nfrom typing import List\n\n\ndef ",
    "Write a JavaScript function that", "How do I reverse a linked list in", "Fix the bug in this code:\n\n```python\n",
    "Write a SQL query that", "Explain what this code does:\n\n```", "Write a bash script that",
    "How do I read a CSV file in", "Write a regular expression that matches", "Implement a class in Python that",
    "Write a unit test for", "Convert this Python code to Rust:\n\n```python\n", "Why does my code throw",
    "Write a function in C that", "How can I speed up this loop?\n\n```python\n", "Implement binary search in",
    "Write a React component that", "Refactor this function to be more readable:\n\n```", "Write a Go program that",
    "What is the difference between a list and a tuple in", "Write a Dockerfile for", "How do I use async/await in",
    "Write a Python script that", "Implement a REST API endpoint in", "Write a recursive function to",
    "Review my code and suggest improvements:\n\n```", "Write a function that checks whether",
    "How do I handle exceptions in", "Write a Java class that", "Implement quicksort in",
    "Write a TypeScript type for", "Write a git command to", "Debug this:\n\n```javascript\n",
    "Write a Python generator that", "How do I parse JSON in",
)
HUMANEVAL_STARTS = _CODE[:3]  # embedded:ask-code's starts
STARTS = {"writing": _WRITING, "rewriting": _REWRITING, "advice": _ADVICE, "explanation": _EXPLANATION,
          "reasoning": _REASONING, "extraction": _EXTRACTION, "roleplay": _ROLEPLAY, "stem": _STEM,
          "humanities": _HUMANITIES, "planning": _PLANNING, "tool-call": _TOOL_CALL, "code": _CODE}

# System turns that frame some of the requests (None: no system turn), so that the same start is asked
# under a few framings and the target answers as it does under them.
SYSTEM_FRAMINGS = (None, "You are a helpful assistant.", None, "You are a concise assistant. Answer briefly.",
                   None, "You are a friendly and knowledgeable assistant.")

FOLLOW_UP_STARTS = (
    "Thanks! Can you", "That's helpful. Now", "Can you make it shorter", "Could you explain", "What about",
    "Great, but", "Can you give me an example of", "Why", "Hmm, I don't think that's right.", "Okay, and",
    "Can you rewrite that", "What if", "Now do the same for", "Could you add", "I didn't understand",
    "Can you go into more detail about", "Perfect. Next,", "How would this change if", "Is there a simpler way to",
    "Can you summarize that in", "Actually, I meant", "One more question:", "Could you turn that into",
    "That's too long.", "What are the downsides of", "Can you check", "Follow-up:", "Nice. Could you also",
    "Wait, why did you", "And how do I", "Make it more", "Could you list", "Can you translate that into",
    "What would you recommend if", "Let's change", "Can you double-check the", "So does that mean",
    "Give me another", "Please fix", "How about",
)
