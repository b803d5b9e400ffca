"""LangChain applications on the real default pair (slow): an LCEL RAG chain over an in-memory
vector store with a real offline embedding model, and a ``create_agent`` tool agent."""

from __future__ import annotations

import re

import pytest
from langchain_core.documents import Document
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnablePassthrough
from langchain_core.tools import tool
from langchain_core.vectorstores import InMemoryVectorStore
from lc_engines import real_engine

from specem_integrations.langchain import ChatSpecEM, SentenceTransformerEmbeddings

pytestmark = pytest.mark.slow

FACTS = [
    "The access code of the Zephyr vault is 7319.",
    "Paris is the capital of France and has about two million inhabitants.",
    "SpecEM ensembles several language models while they generate, segment by segment.",
    "The Atlantic Ocean lies between the Americas and Europe and Africa.",
]


def test_embeddings_are_real_and_offline() -> None:
    emb = SentenceTransformerEmbeddings()
    vault, paris = emb.embed_documents(FACTS[:2])
    query = emb.embed_query("What is the code of the vault?")
    assert len(query) == 384
    dot = lambda a, b: sum(x * y for x, y in zip(a, b, strict=True))  # noqa: E731
    assert dot(query, vault) > dot(query, paris)


def test_rag_chain_answers_from_the_retrieved_fact() -> None:
    store = InMemoryVectorStore(SentenceTransformerEmbeddings())
    store.add_documents([Document(page_content=f) for f in FACTS])
    retriever = store.as_retriever(search_kwargs={"k": 1})

    def join(docs: list[Document]) -> str:
        return "\n".join(d.page_content for d in docs)

    prompt = ChatPromptTemplate.from_messages(
        [
            ("system", "Answer the question using only this context:\n{context}"),
            ("human", "{question}"),
        ]
    )
    llm = ChatSpecEM(engine=real_engine(), max_tokens=24)
    chain = {"context": retriever | join, "question": RunnablePassthrough()} | prompt | llm | StrOutputParser()
    question = "What is the access code of the Zephyr vault?"
    assert "7319" in join(retriever.invoke(question))
    answer = chain.invoke(question)
    assert "7319" in answer, answer


def test_create_agent_calls_a_python_tool_and_uses_its_result() -> None:
    from langchain.agents import create_agent

    calls: list[tuple[int, int]] = []

    @tool
    def multiply(a: int, b: int) -> int:
        """Multiply two integers."""
        calls.append((a, b))
        return a * b

    agent = create_agent(ChatSpecEM(engine=real_engine(), max_tokens=40), tools=[multiply])
    out = agent.invoke({"messages": [("user", "What is 6 times 7? Use the multiply tool.")]}, {"recursion_limit": 8})
    assert calls
    assert calls[0] in ((6, 7), (7, 6))
    final = out["messages"][-1]
    assert not final.tool_calls
    assert re.search(r"\b42\b", str(final.content)), final.content
